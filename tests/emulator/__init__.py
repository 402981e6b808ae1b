"""A Kubernetes API emulator for tests: kmock's scaffold serving a stateful store.

kmock's ``KubernetesEmulator`` keeps objects without resourceVersion, uid, generation,
label selectors, conflicts or garbage collection, and kopf needs those (without a bumped
resourceVersion it runs create handlers twice).  So :class:`ApiEmulator` keeps kmock's
``KubernetesScaffold`` (HTTP server, URL parsing, API discovery, ``Status`` errors) and
replaces the object handling with :class:`tests.emulator.store.Store`.

Use it as an async context manager; it listens on 127.0.0.1 on a free port and writes a
kubeconfig pointing at itself::

    async with ApiEmulator(tmp_path) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig_path))
        api.create("v1/configmaps", "default", {"metadata": {"name": "x"}, "data": {}})
        api.patch("v1/configmaps", "default", "x", {"data": {"k": "v"}})  # merge patch
        api.get("v1/configmaps", "default", "x")["metadata"]["resourceVersion"]

Clients reach it over HTTP at ``api.url`` (PATCH with ``application/merge-patch+json``,
``?watch=true&resourceVersion=N`` streams, ``labelSelector``, ``/status``).  The helper
methods go through the same store, so watchers see their writes.  Resources are declared
in :data:`RESOURCES` (kind, and whether they have a status subresource).

Faults (409s, 500s, 410 Gone on watches, slow answers) are injected through
``api.faults`` (:mod:`tests.emulator.faults`); with no rules the emulator behaves as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiohttp.web
import attrs
import yaml
from kmock import KubernetesScaffold, ResourceInfo, Server
from tests.support.processes import free_port

from .faults import ApiFault, ApiFaults
from .store import ApiStatusError, Store, field_matches, label_matches, merge_patch

__all__ = [
    "RESOURCES",
    "ApiEmulator",
    "ApiFault",
    "ApiFaults",
    "ApiStatusError",
    "Store",
    "merge_patch",
]

#: resource key -> (kind, has a status subresource)
RESOURCES: dict[str, tuple[str, bool]] = {
    "v1/pods": ("Pod", True),
    "v1/services": ("Service", True),
    "v1/configmaps": ("ConfigMap", False),
    "v1/serviceaccounts": ("ServiceAccount", False),
    "v1/secrets": ("Secret", False),
    "v1/events": ("Event", False),
    "v1/namespaces": ("Namespace", True),
    "rbac.authorization.k8s.io/v1/roles": ("Role", False),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", False),
    "refit.dev/v1alpha1/refitjobs": ("RefitJob", True),
    "coordination.k8s.io/v1/leases": ("Lease", False),
}
#: resource key -> short names that discovery advertises (``kubectl get rj``, ``svc``, ``cm``)
SHORT_NAMES: dict[str, tuple[str, ...]] = {
    "v1/pods": ("po",),
    "v1/services": ("svc",),
    "v1/configmaps": ("cm",),
    "v1/serviceaccounts": ("sa",),
    "v1/events": ("ev",),
    "v1/namespaces": ("ns",),
    "refit.dev/v1alpha1/refitjobs": ("rj",),
}
_VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}
#: How often an idle watch checks whether its client went away (no busy loop).
_WATCH_TICK_S = 0.5
#: Bound on starting and stopping the server thread.
_START_STOP_S = 30.0


@attrs.define(kw_only=True)
class _Handler(KubernetesScaffold):
    store: Store = attrs.field(factory=Store)
    changed: asyncio.Condition = attrs.field(factory=asyncio.Condition)
    faults: ApiFaults = attrs.field(factory=ApiFaults)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, (kind, has_status) in RESOURCES.items():
            self.resources[key] = ResourceInfo(
                kind=kind,
                singular=kind.lower(),
                shortnames=SHORT_NAMES.get(key, ()),
                namespaced=key != "v1/namespaces",
                verbs=_VERBS,
                subresources={"status"} if has_status else set(),
            )
            if has_status:
                self.store.status_resources.add(key)

    async def _serve_version(self, request: Any) -> Any:
        # kmock writes the core group's version as "/v1", which kubectl cannot resolve, and
        # gives subresources the names of their parent, which the apiserver never does.
        payload = await super()._serve_version(request)
        payload["groupVersion"] = payload["groupVersion"].lstrip("/")
        for entry in payload["resources"]:
            if "/" in entry["name"]:
                entry["singularName"], entry["shortNames"] = "", []
        return payload

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or not res.plural:
            return await super()._handle(request)  # discovery, /version and the like
        key = f"{res.group}/{res.version}/{res.plural}".lstrip("/")
        if key not in RESOURCES:
            return _status(ApiStatusError(404, "NotFound", f"resource {key} is not served"))
        watch = request.method.value == "GET" and request.params.get("watch") in ("true", "1")
        fault = self.faults.take(
            request.method.value, key, request.name or "", watch, request.subresource or ""
        )
        if fault is not None:
            await asyncio.sleep(fault.delay)
            if fault.code == 410 and watch:
                return await self._expired(request)
            if fault.code is not None:
                return _status(
                    ApiStatusError(fault.code, fault.reason, f"injected fault: HTTP {fault.code}")
                )
        try:
            return await self._serve(request, key)
        except ApiStatusError as exc:
            return _status(exc)

    async def _expired(self, request: Any) -> aiohttp.web.StreamResponse:
        """What an apiserver answers a watch from a too-old resourceVersion."""
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        gone = ApiStatusError(410, "Expired", "injected fault: too old resource version")
        await _line(response, "ERROR", gone.body())
        return response

    async def _serve(self, request: Any, key: str) -> aiohttp.web.StreamResponse:
        method, ns, name = request.method.value, request.namespace, request.name
        params = request.params
        if method == "GET" and params.get("watch") in ("true", "1"):
            return await self._watch(request, key)
        if method == "GET" and name:
            return _json(self._typed(key, self.store.get(key, ns, name)))
        if method == "GET":
            items = self.store.list(
                key, ns, params.get("labelSelector", ""), params.get("fieldSelector", "")
            )
            kind = RESOURCES[key][0]
            return _json(
                {
                    "apiVersion": _api_version(key),
                    "kind": f"{kind}List",
                    "metadata": {"resourceVersion": str(self.store.rv)},
                    "items": [self._typed(key, i) for i in items],
                }
            )
        body = request.data if isinstance(request.data, dict | list) else {}
        if method == "POST" and not name:
            if not isinstance(body, dict):
                raise ApiStatusError(400, "BadRequest", "the body of a create must be an object")
            result = self.store.create(key, ns, body)
        elif method == "PATCH" and name:
            ctype = request.headers.get("Content-Type", "")
            result = self.store.write(
                key,
                ns,
                name,
                body,
                patch="json" if "json-patch" in ctype else True,
                subresource=request.subresource or "",
            )
        elif method == "PUT" and name:
            result = self.store.write(
                key, ns, name, body, patch=False, subresource=request.subresource or ""
            )
        elif method == "DELETE" and name:
            result = self.store.delete(key, ns, name)
        else:
            raise ApiStatusError(405, "MethodNotAllowed", f"{method} {request.url.path}")
        async with self.changed:
            self.changed.notify_all()
        return _json(self._typed(key, result))

    def _typed(self, key: str, obj: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": _api_version(key), "kind": RESOURCES[key][0], **obj}

    async def _watch(self, request: Any, key: str) -> aiohttp.web.StreamResponse:
        ns, params = request.namespace, request.params
        selector, fields = params.get("labelSelector", ""), params.get("fieldSelector", "")
        since_text = params.get("resourceVersion", "")
        since = int(since_text) if since_text not in ("", "0") else None
        timeout = float(params.get("timeoutSeconds", "0") or 0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        raw = request._raw_request
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        if since is None:
            for obj in self.store.list(key, ns, selector, fields):
                await _line(response, "ADDED", self._typed(key, obj))
            since = self.store.rv
        while deadline is None or loop.time() < deadline:
            try:
                events = self.store.events_since(since)
            except ApiStatusError as exc:  # like the apiserver: 200, then an ERROR event
                await _line(response, "ERROR", exc.body())
                break
            for ev in events:
                since = ev.rv
                if ev.resource != key or (ns is not None and ev.obj["metadata"]["namespace"] != ns):
                    continue
                labels = ev.obj["metadata"].get("labels") or {}
                if store_matches(selector, fields, labels, ev.obj):
                    await _line(response, ev.type, self._typed(key, ev.obj))
            if raw.transport is None or raw.transport.is_closing():
                break
            async with self.changed:
                with contextlib.suppress(TimeoutError):  # a tick to notice a gone client
                    await asyncio.wait_for(self.changed.wait(), _WATCH_TICK_S)
        return response


def store_matches(selector: str, fields: str, labels: dict[str, str], obj: dict[str, Any]) -> bool:
    return label_matches(selector, labels) and field_matches(fields, obj)


async def _line(response: aiohttp.web.StreamResponse, type_: str, obj: dict[str, Any]) -> None:
    await response.write(json.dumps({"type": type_, "object": obj}).encode() + b"\n")


def _api_version(key: str) -> str:
    return key.rsplit("/", 1)[0]


def _json(obj: dict[str, Any]) -> aiohttp.web.Response:
    return aiohttp.web.json_response(obj)


def _status(exc: ApiStatusError) -> aiohttp.web.Response:
    return aiohttp.web.json_response(exc.body(), status=exc.code)


class ApiEmulator:
    """The emulator on a real TCP port, with a kubeconfig and direct store helpers.

    The HTTP server runs on its own thread and event loop, like an apiserver in another
    process: nothing the test's loop does (an operator stopping and cancelling its tasks,
    a blocking call) can stall the answers to worker processes.
    """

    def __init__(self, workdir: Path, *, history_limit: int = 100_000) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kubeconfig_path = workdir / "kubeconfig.yaml"
        self._handler = _Handler(store=Store(history_limit=history_limit))
        self._server = Server(self._handler, port=self.port)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"api-emulator-{self.port}", daemon=True
        )

    @property
    def store(self) -> Store:
        return self._handler.store

    @property
    def faults(self) -> ApiFaults:
        """Rules for injected faults (see :mod:`tests.emulator.faults`)."""
        return self._handler.faults

    async def __aenter__(self) -> Self:
        self._thread.start()
        started = await asyncio.to_thread(self._started.wait, _START_STOP_S)
        if self._error is not None:
            raise RuntimeError(f"the API emulator did not start: {self._error}") from self._error
        if not started:
            raise TimeoutError(f"the API emulator did not start within {_START_STOP_S}s")
        self.kubeconfig_path.write_text(yaml.safe_dump(_kubeconfig(self.url)))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        await asyncio.to_thread(self._thread.join, _START_STOP_S)
        if self._thread.is_alive():
            raise TimeoutError(f"the API emulator did not stop within {_START_STOP_S}s")

    def _run(self) -> None:
        try:
            asyncio.run(self._serve_until_stopped())
        except BaseException as exc:  # reported by __aenter__
            self._error = exc
            self._started.set()

    async def _serve_until_stopped(self) -> None:
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        async with self._handler, self._server:
            self._started.set()
            await self._stopping.wait()
            self._drop_connections()

    def _drop_connections(self) -> None:
        # A stopped apiserver drops its connections. aiohttp's graceful shutdown instead
        # waits (up to 60 s) for a request that came in on a kept-alive connection as the
        # stop began, whose client then sits out its 30 s read timeout: a teardown that
        # outlasted _START_STOP_S beside a busy core.
        runner = self._server.server.runner
        web_server = runner.server if runner is not None else None
        for connection in web_server.connections if web_server is not None else ():
            connection.force_close()

    def _notify(self) -> None:
        async def wake() -> None:
            async with self._handler.changed:
                self._handler.changed.notify_all()

        loop = self._loop
        if loop is not None and not loop.is_closed():
            # Watches wait on a condition of the emulator's loop: wake them there (the
            # returned future keeps the task referenced until it ran).
            asyncio.run_coroutine_threadsafe(wake(), loop)

    # Direct helpers (the test's own hands on the cluster, like kubectl or a kubelet).
    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        return self.store.get(resource, namespace, name)

    def find(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.store.get(resource, namespace, name)
        except ApiStatusError:
            return None

    def list(self, resource: str, namespace: str | None = None, selector: str = "") -> list[Any]:
        return self.store.list(resource, namespace, selector)

    def create(self, resource: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        out = self.store.create(resource, namespace, body)
        self._notify()
        return out

    def patch(
        self,
        resource: str,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        *,
        status: bool = False,
    ) -> dict[str, Any]:
        out = self.store.write(
            resource, namespace, name, patch, patch=True, subresource="status" if status else ""
        )
        self._notify()
        return out

    def delete(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        out = self.store.delete(resource, namespace, name)
        self._notify()
        return out


def _kubeconfig(url: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": "emulator-token"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
        "current-context": "emulator",
    }
