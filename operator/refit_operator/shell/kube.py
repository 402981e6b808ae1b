"""The one module that talks to the Kubernetes API: idempotent create, delete, patch, list.

Credentials are found the standard way (``credentials.py``), from :meth:`Kube.connect`
when the operator starts, never at import; Events are written as ``events.py`` decides.
Requests go over aiohttp, so the event loop is never blocked.  Objects are plain dicts
(one representation everywhere).
"""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import aiohttp

from refit_operator.api import models, names
from refit_operator.shell import events
from refit_operator.shell.credentials import load_credentials

#: (apiVersion, kind) -> plural of every kind the operator touches.
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "Pod"): "pods",
    ("v1", "Service"): "services",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Event"): "events",
    (events.EVENTS_V1, "Event"): "events",
    ("coordination.k8s.io/v1", "Lease"): "leases",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    (models.API_VERSION, models.KIND): models.PLURAL,
    # A gang's PodGroup, for Volcano or the scheduler-plugins coscheduling plugin.
    ("scheduling.volcano.sh/v1beta1", "PodGroup"): "podgroups",
    ("scheduling.x-k8s.io/v1alpha1", "PodGroup"): "podgroups",
}

_LEASE = ("coordination.k8s.io/v1", "Lease")
_RBAC = "rbac.authorization.k8s.io/v1"
_VOLCANO, _COSCHEDULING = "scheduling.volcano.sh/v1beta1", "scheduling.x-k8s.io/v1alpha1"

#: (apiVersion, kind) -> the verbs the operator's account uses on it: every call of this
#: module (the only client of the API) and what kopf does with the handlers' resources.
#: The chart grants exactly these (and the rights the per-job worker Roles hand on, which
#: Kubernetes refuses to let an account grant without holding them);
#: ``tests/integration/test_chart_rbac.py`` checks both ways.  No kind is ever ``update``d
#: (every write is a merge patch) and no child but a pod or PodGroup is ever deleted: the
#: rest go with their job by ownerReference.
VERBS: dict[tuple[str, str], frozenset[str]] = {
    # get: each round reads its job; list: the resync, and kopf's; watch: kopf; patch:
    # kopf's annotations (diff base, progress) and the old finalizer it removes; delete:
    # the job itself once its ttlSecondsAfterFinished ran out.
    (models.API_VERSION, models.KIND): frozenset({"get", "list", "watch", "patch", "delete"}),
    # list: each round's children (by the job label); watch: kopf's child events; patch:
    # the gang's scheduling gate; delete: restarts, replacements, force deletes.
    ("v1", "Pod"): frozenset({"list", "watch", "create", "delete", "patch"}),
    # patch: the operator's rendezvous keys (barrier, preemption notice, epoch clearing).
    ("v1", "ConfigMap"): frozenset({"list", "watch", "create", "patch"}),
    # Created once, listed each round (``STATIC_KINDS``), never changed or deleted.
    ("v1", "Service"): frozenset({"list", "create"}),
    ("v1", "Secret"): frozenset({"list", "create"}),
    ("v1", "ServiceAccount"): frozenset({"list", "create"}),
    (_RBAC, "Role"): frozenset({"list", "create"}),
    (_RBAC, "RoleBinding"): frozenset({"list", "create"}),
    # patch: a repeat updates its Event's series (``events.py``).
    ("v1", "Event"): frozenset({"create", "patch"}),
    (events.EVENTS_V1, "Event"): frozenset({"create", "patch"}),
    # The epoch's PodGroup: created with its gang, deleted with it; never read.
    (_VOLCANO, "PodGroup"): frozenset({"create", "delete"}),
    (_COSCHEDULING, "PodGroup"): frozenset({"create", "delete"}),
    # The leader Lease (``leader.py``), in the release's namespace only.
    _LEASE: frozenset({"get", "create", "patch"}),
}

#: (apiVersion, kind, subresource) -> verbs: the RefitJob's status, merge-patched each
#: round (``kube_writes.py``); kopf writes none (its progress is kept in annotations).
SUBRESOURCE_VERBS: dict[tuple[str, str, str], frozenset[str]] = {
    (models.API_VERSION, models.KIND, "status"): frozenset({"patch"}),
}

#: Cluster-scoped kinds the operator only reads, by name, with the verbs it uses (the
#: chart grants exactly these; ``tests/integration/test_chart_rbac.py`` checks).  Nothing
#: reads CRDs or Namespaces: kopf's scanning is off (``settings.py``), so it finds the
#: RefitJobs by API discovery (open to every account) and watches the namespaces given.
CLUSTER_READS: dict[tuple[str, str], tuple[str, frozenset[str]]] = {
    ("v1", "Node"): ("nodes", frozenset({"get"})),
}

#: Non-pod children, listed by the job label on every reconcile.
STATIC_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("v1", "Secret"),
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
)

MERGE_PATCH = "application/merge-patch+json"
#: ``reportingController`` of the operator's Events (a qualified name, as the API wants).
EVENT_CONTROLLER = f"{models.GROUP}/{names.MANAGER}"


class ApiError(Exception):
    """The API answered with an error status: the code, the apiserver's ``Status.reason``
    (``Forbidden``, ``Invalid``, ...) and its message, word for word."""

    def __init__(self, status: int, method: str, path: str, message: str, reason: str = "") -> None:
        super().__init__(f"{method} {path} -> HTTP {status}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class ConflictError(ApiError):
    """HTTP 409: the object changed since it was read (or already exists)."""


def _status_of(text: str) -> tuple[str, str]:
    """(message, reason) of an error answer: a ``Status`` object, or any other text."""
    try:
        body = json.loads(text)
    except ValueError:
        return text, ""
    if not isinstance(body, dict):
        return text, ""
    return str(body.get("message", text)), str(body.get("reason") or "")


def collection_path(api_version: str, kind: str, namespace: str | None) -> str:
    """The collection's path in ``namespace``; in all namespaces when it is None."""
    try:
        plural = PLURALS[(api_version, kind)]
    except KeyError:
        raise ValueError(f"the operator does not manage {kind} of {api_version}") from None
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace is None:
        return f"{base}/{plural}"
    return f"{base}/namespaces/{quote(namespace)}/{plural}"


def object_path(api_version: str, kind: str, namespace: str, name: str) -> str:
    return f"{collection_path(api_version, kind, namespace)}/{quote(name)}"


class Kube:
    """A thin async client; construct with :meth:`connect` (or directly in tests)."""

    def __init__(
        self,
        server: str,
        *,
        headers: Callable[[], Mapping[str, str]] = dict,
        ssl_context: ssl.SSLContext | bool = True,
        timeout_s: float = 30.0,
    ) -> None:
        self._server = server.rstrip("/")
        self._headers = headers
        self._ssl = ssl_context
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        #: Told of every error answer (method, HTTP status; None when none came): metrics.
        self.on_error: Callable[[str, int | None], None] = _ignore_error
        #: Which Events were posted, so repeats update a series (see ``events``).
        self.recorder = events.EventRecorder(
            controller=EVENT_CONTROLLER, instance=socket.gethostname()
        )
        self._events_api: str | None = None

    @classmethod
    def connect(cls, timeout_s: float = 30.0) -> Kube:
        """Load credentials the standard way (call at start-up, not import)."""
        creds = load_credentials()
        context: ssl.SSLContext | bool = False
        if creds.verify:
            context = ssl.create_default_context(cafile=creds.ca_path)
            if creds.cert_path:
                context.load_cert_chain(creds.cert_path, creds.key_path)
        return cls(creds.server, headers=creds.headers, ssl_context=context, timeout_s=timeout_s)

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        if self._closed:
            raise RuntimeError(f"{method} {path}: the API client is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        headers = {**self._headers(), "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        try:
            async with self._session.request(
                method,
                self._server + path,
                data=data,
                params=params,
                headers=headers,
                ssl=self._ssl,
            ) as response:
                text = await response.text()
        except (TimeoutError, aiohttp.ClientError):
            self.on_error(method, None)
            raise
        if response.status >= 400:
            self.on_error(method, response.status)
            message, reason = _status_of(text)
            error = ConflictError if response.status == 409 else ApiError
            raise error(response.status, method, path, message, reason)
        return json.loads(text) if text else None

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", object_path(api_version, kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self, api_version: str, kind: str, namespace: str | None, selector: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        """Objects matching the label selector (in every namespace when ``namespace`` is
        None), each with its kind filled in."""
        label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        result = await self.request(
            "GET",
            collection_path(api_version, kind, namespace),
            params={"labelSelector": label_selector},
        )
        items: list[dict[str, Any]] = result.get("items") or []
        return [{**item, "apiVersion": api_version, "kind": kind} for item in items]

    async def create(self, obj: Mapping[str, Any]) -> bool:
        """Create ``obj``; False (not an error) when it already exists."""
        meta = obj["metadata"]
        path = collection_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        try:
            await self.request("POST", path, body=obj)
        except ConflictError:
            return False
        return True

    async def delete(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        *,
        options: Mapping[str, Any] | None = None,
    ) -> bool:
        """Delete (with ``DeleteOptions`` when given); False (not an error) when it is
        already gone."""
        body = None if options is None else {"apiVersion": "v1", "kind": "DeleteOptions", **options}
        try:
            await self.request("DELETE", object_path(api_version, kind, namespace, name), body=body)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def get_node(self, name: str) -> Any:
        """The cluster-scoped Node ``name``, or None when it does not exist."""
        try:
            return await self.request("GET", f"/api/v1/nodes/{quote(name)}")
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def merge_patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str = "",
    ) -> Any:
        """JSON merge patch; a ``metadata.resourceVersion`` in it makes the write conditional."""
        path = object_path(api_version, kind, namespace, name)
        if subresource:
            path += "/" + subresource
        return await self.request("PATCH", path, body=patch, content_type=MERGE_PATCH)

    async def post_event(
        self, job: Mapping[str, Any], type_: str, reason: str, message: str
    ) -> None:
        """An Event about ``job`` (``kubectl describe rj`` shows it), recorded the standard
        way: a repeat of the same Event updates its series instead of adding another."""
        key = events.EventKey.about(job, type_, reason, message)
        now = datetime.now(UTC)
        repeat = self.recorder.repeat(key, now)
        if repeat is not None:
            path = object_path(repeat.api_version, "Event", key.namespace, repeat.name)
            try:
                await self.request("PATCH", path, body=repeat.patch, content_type=MERGE_PATCH)
            except ApiError as exc:
                if exc.status != 404:
                    raise
                self.recorder.forget(key)  # expired from the API: start a new one
            else:
                self.recorder.posted(key, repeat)
                return
        new = self.recorder.new(key, now, await self._event_api_version())
        path = collection_path(new.api_version, "Event", key.namespace)
        created = await self.request("POST", path, body=new.body)
        self.recorder.posted(key, new, str((created or {}).get("metadata", {}).get("name", "")))

    async def _event_api_version(self) -> str:
        """``events.k8s.io/v1`` when the cluster serves it, else core/v1 (asked once)."""
        if self._events_api is None:
            try:
                found = await self.request("GET", f"/apis/{events.EVENTS_V1}")
            except ApiError as exc:
                if exc.status != 404:
                    raise
                self._events_api = events.CORE_V1
            else:
                served = {r.get("name") for r in (found or {}).get("resources") or []}
                self._events_api = events.EVENTS_V1 if "events" in served else events.CORE_V1
        return self._events_api


def _ignore_error(method: str, status: int | None) -> None:
    """The default ``on_error``: nobody counts."""
