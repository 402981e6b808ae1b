"""An in-memory object store with the apiserver semantics the operator relies on.

What it does like a real apiserver: a cluster-wide ``resourceVersion`` bumped on every
write; ``uid``, ``creationTimestamp`` and ``generation`` (bumped when anything but metadata
and status changes); ``generateName``; 409 on creating an existing name and on a stale
``metadata.resourceVersion`` precondition (PUT and PATCH); JSON merge patch (RFC 7386); the
status subresource (main writes keep the status, status writes keep everything else);
finalizers and ``deletionTimestamp``; cascading (background) deletion of objects whose
ownerReferences name a deleted uid; label and field selectors; an event history so that
watches resume from a resourceVersion and get 410 Gone when it is too old.

What it does not: admission, schema validation, defaulting, strategic merge (treated as a
merge patch), server-side apply, kubelets or controllers (nothing moves pods by itself).

Pure Python, no I/O, thread-safe (one lock around each operation: the HTTP server runs on
its own thread while tests write through the helpers); ``tests/emulator/__init__.py`` serves
it over HTTP through kmock.
"""

from __future__ import annotations

import builtins
import copy
import functools
import re
import threading
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Concatenate, ParamSpec, TypeVar

Key = tuple[str, str, str]  # (resource "group/version/plural", namespace, name)


class ApiStatusError(Exception):
    """An error the server answers with a ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def body(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "code": self.code,
            "reason": self.reason,
            "message": self.message,
        }


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, null deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiStatusError(422, "Invalid", f"JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str], path: str) -> Any:
    for part in parts:
        try:
            doc = doc[int(part)] if isinstance(doc, list) else doc[part]
        except (KeyError, IndexError, ValueError):
            raise ApiStatusError(
                422, "Invalid", f"JSON patch path {path!r} does not exist"
            ) from None
    return doc


def json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902: add, remove, replace, test, move, copy (kopf sends some of these)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, path = op.get("op"), op.get("path", "")
        if kind in ("move", "copy"):
            value = copy.deepcopy(_walk(doc, _pointer(op["from"]), op["from"]))
            if kind == "move":
                doc = json_patch(doc, [{"op": "remove", "path": op["from"]}])
            doc = json_patch(doc, [{"op": "add", "path": path, "value": value}])
            continue
        parts = _pointer(path)
        if kind == "test":
            if _walk(doc, parts, path) != op.get("value"):
                raise ApiStatusError(422, "Invalid", f"JSON patch test failed at {path!r}")
            continue
        if not parts:
            doc = copy.deepcopy(op.get("value"))
            continue
        parent, last = _walk(doc, parts[:-1], path), parts[-1]
        if kind == "add" and isinstance(parent, list):
            parent.insert(len(parent) if last == "-" else int(last), copy.deepcopy(op["value"]))
        elif kind in ("add", "replace"):
            if kind == "replace":
                _walk(parent, [last], path)
            if isinstance(parent, list):
                parent[int(last)] = copy.deepcopy(op["value"])
            else:
                parent[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            _walk(parent, [last], path)
            del parent[int(last) if isinstance(parent, list) else last]
        else:
            raise ApiStatusError(422, "Invalid", f"unknown JSON patch op {kind!r}")
    return doc


_REQ = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts


def label_matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Equality (=, ==, !=), set (in, notin) and existence (key, !key) requirements."""
    for raw_req in _split_selector(selector or ""):
        req = raw_req.strip()
        if not req:
            continue
        m = _REQ.match(req)
        if m:
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if (op == "in") != (labels.get(key) in values):
                return False
        elif "!=" in req:
            key, value = (s.strip() for s in req.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in req:
            key, value = (s.strip() for s in req.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif req.startswith("!"):
            if req[1:].strip() in labels:
                return False
        elif req not in labels:
            return False
    return True


def field_matches(selector: str, obj: Mapping[str, Any]) -> bool:
    """Only ``metadata.name`` and ``metadata.namespace`` (= and !=)."""
    meta = obj.get("metadata") or {}
    for req in _split_selector(selector or ""):
        negate = "!=" in req
        key, value = (s.strip() for s in req.replace("!=", "=").replace("==", "=").split("=", 1))
        if key not in ("metadata.name", "metadata.namespace"):
            raise ApiStatusError(400, "BadRequest", f"field selector {key!r} is not supported")
        actual = meta.get(key.split(".", 1)[1])
        if (actual == value) == negate:
            return False
    return True


@dataclass
class Event:
    rv: int
    resource: str
    type: str
    obj: dict[str, Any]


P = ParamSpec("P")
R = TypeVar("R")


def _locked(method: Callable[Concatenate[Store, P], R]) -> Callable[Concatenate[Store, P], R]:
    @functools.wraps(method)
    def wrapper(self: Store, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.lock:
            return method(self, *args, **kwargs)

    return wrapper


@dataclass
class Store:
    """All objects of all resources, plus the write history for watches."""

    #: resource -> has a status subresource
    status_resources: set[str] = field(default_factory=set)
    history_limit: int = 100_000
    objects: dict[Key, dict[str, Any]] = field(default_factory=dict)
    history: deque[Event] = field(default_factory=deque)
    rv: int = 1
    #: resourceVersion of the oldest event still in the history (older: 410 Gone).
    oldest_rv: int = 1
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def _record(self, resource: str, type_: str, obj: dict[str, Any]) -> None:
        self.history.append(Event(self.rv, resource, type_, copy.deepcopy(obj)))
        while len(self.history) > self.history_limit:
            self.oldest_rv = self.history.popleft().rv + 1

    def _bump(self, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    @_locked
    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        obj = self.objects.get((resource, namespace, name))
        if obj is None:
            raise ApiStatusError(404, "NotFound", f"{resource} {namespace}/{name} not found")
        return copy.deepcopy(obj)

    @_locked
    def list(
        self,
        resource: str,
        namespace: str | None,
        label_selector: str = "",
        field_selector: str = "",
    ) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj)
            for (res, ns, _), obj in sorted(self.objects.items())
            if res == resource
            and (namespace is None or ns == namespace)
            and label_matches(label_selector, obj["metadata"].get("labels") or {})
            and field_matches(field_selector, obj)
        ]

    @_locked
    def create(self, resource: str, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(dict(body))
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
        name = meta.get("name")
        if not name:
            raise ApiStatusError(422, "Invalid", "metadata.name or generateName is required")
        if meta.get("namespace", namespace) != namespace:
            raise ApiStatusError(400, "BadRequest", "metadata.namespace does not match the URL")
        if (resource, namespace, name) in self.objects:
            raise ApiStatusError(409, "AlreadyExists", f"{resource} {namespace}/{name} exists")
        meta.update(
            namespace=namespace,
            uid=str(uuid.uuid4()),
            generation=1,
            creationTimestamp=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        meta.pop("deletionTimestamp", None)
        self._bump(obj)
        self.objects[(resource, namespace, name)] = obj
        self._record(resource, "ADDED", obj)
        return copy.deepcopy(obj)

    @_locked
    def write(
        self,
        resource: str,
        namespace: str,
        name: str,
        body: Any,
        *,
        patch: bool | str,
        subresource: str = "",
    ) -> dict[str, Any]:
        """PATCH (merge, or ``patch="json"`` for RFC 6902) or PUT of the object or its status."""
        key = (resource, namespace, name)
        if key not in self.objects:
            raise ApiStatusError(404, "NotFound", f"{resource} {namespace}/{name} not found")
        old = self.objects[key]
        if patch == "json":
            body = json_patch(old, body if isinstance(body, list) else [])
            patch = False
        wanted_rv = (body.get("metadata") or {}).get("resourceVersion")
        if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
            raise ApiStatusError(
                409,
                "Conflict",
                f"the object has been modified (resourceVersion {wanted_rv} is stale,"
                f" now {old['metadata']['resourceVersion']}); apply to the latest version",
            )
        new = merge_patch(old, body) if patch else copy.deepcopy(dict(body))
        has_status = resource in self.status_resources
        if subresource == "status":
            new = {**copy.deepcopy(old), "status": new.get("status")}
        elif has_status:
            new["status"] = copy.deepcopy(old.get("status"))
        if new.get("status") is None:
            new.pop("status", None)
        meta = new.setdefault("metadata", {})
        for fixed in ("uid", "creationTimestamp", "namespace", "name", "generation"):
            if fixed in old["metadata"]:
                meta[fixed] = old["metadata"][fixed]
        if old["metadata"].get("deletionTimestamp"):
            meta["deletionTimestamp"] = old["metadata"]["deletionTimestamp"]

        def essence(o: Mapping[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in o.items() if k not in ("metadata", "status")}

        if essence(new) != essence(old):
            meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
        if new == old:
            return copy.deepcopy(old)  # a no-op write keeps the resourceVersion, as upstream
        self._bump(new)
        self.objects[key] = new
        self._record(resource, "MODIFIED", new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._remove(key)
        return copy.deepcopy(new)

    @_locked
    def delete(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        key = (resource, namespace, name)
        if key not in self.objects:
            raise ApiStatusError(404, "NotFound", f"{resource} {namespace}/{name} not found")
        obj = self.objects[key]
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                obj["metadata"]["deletionTimestamp"] = now
                self._bump(obj)
                self._record(resource, "MODIFIED", obj)
            return copy.deepcopy(obj)
        return self._remove(key)

    def _remove(self, key: Key) -> dict[str, Any]:
        obj = self.objects.pop(key)
        self._bump(obj)
        self._record(key[0], "DELETED", obj)
        uid = obj["metadata"]["uid"]
        # Background garbage collection: dependents go once their owner is gone.
        for dep_key, dep in list(self.objects.items()):
            refs = dep["metadata"].get("ownerReferences") or []
            if dep_key in self.objects and any(r.get("uid") == uid for r in refs):
                self.delete(*dep_key)
        return obj

    @_locked
    def events_since(self, rv: int) -> builtins.list[Event]:
        if rv + 1 < self.oldest_rv:
            raise ApiStatusError(
                410, "Expired", f"too old resource version: {rv} ({self.oldest_rv})"
            )
        return [e for e in self.history if e.rv > rv]
