"""Kubernetes Events with the standard recorder's semantics, decided here; ``kube`` posts.

An Event is identified the way the legacy recorder's correlator identifies one: the object
it is about (its uid), type, reason, action and message.  The first occurrence creates an
Event; a repeat within :data:`SERIES_WINDOW_S` of the last one does not create another but
updates the first one's series (``series.count`` and ``series.lastObservedTime`` in
``events.k8s.io/v1``, ``count`` and ``lastTimestamp`` in core/v1), which ``kubectl
describe`` shows as ``(x3 over 2m)``.  After the window, or when the Event has expired
from the API (a 404 on the update), the next occurrence starts a new Event.

``events.k8s.io/v1`` is used when the cluster serves it (every supported Kubernetes
does), core/v1 otherwise; ``kube`` finds out once.

Pure: a state machine over the recorder's memory, no I/O.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

EVENTS_V1 = "events.k8s.io/v1"
CORE_V1 = "v1"
#: A repeat this soon after the last occurrence joins its series (client-go: 6 minutes).
SERIES_WINDOW_S = 6 * 60.0
#: Distinct Events remembered; the least recently seen is forgotten first (client-go: 4096).
MAX_REMEMBERED = 4096
#: What the API accepts in ``note`` / ``message`` (events.k8s.io/v1 refuses more than 1 kB).
MAX_NOTE = 1024
#: ``action`` of every Event the operator posts: what it was doing when it noticed.
RECONCILE = "Reconcile"


@dataclass(frozen=True)
class EventKey:
    """What makes two Events the same Event."""

    namespace: str
    api_version: str
    kind: str
    name: str
    uid: str
    type: str
    reason: str
    action: str
    note: str

    @classmethod
    def about(
        cls,
        obj: Mapping[str, Any],
        type_: str,
        reason: str,
        note: str,
        action: str = RECONCILE,
    ) -> EventKey:
        meta = obj["metadata"]
        return cls(
            namespace=str(meta["namespace"]),
            api_version=str(obj["apiVersion"]),
            kind=str(obj["kind"]),
            name=str(meta["name"]),
            uid=str(meta.get("uid", "")),
            type=type_,
            reason=reason,
            action=action,
            note=note[:MAX_NOTE],
        )

    def regarding(self) -> dict[str, str]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "namespace": self.namespace,
            "uid": self.uid,
        }


@dataclass(frozen=True)
class NewEvent:
    """Create ``body`` (an Event of ``api_version``)."""

    api_version: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Repeat:
    """Merge-patch the Event ``name`` with ``patch``: its series is now ``count`` long."""

    api_version: str
    name: str
    count: int
    patch: dict[str, Any]


@dataclass
class _Seen:
    api_version: str
    name: str
    count: int
    last: float  # the recorder's clock


def micro_time(when: datetime) -> str:
    """``metav1.MicroTime``: RFC 3339 in UTC with microseconds."""
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def plain_time(when: datetime) -> str:
    """``metav1.Time``: RFC 3339 in UTC, whole seconds."""
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    """Which Event to create or update next, remembering what was posted."""

    def __init__(
        self,
        *,
        controller: str,
        instance: str,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = SERIES_WINDOW_S,
        max_remembered: int = MAX_REMEMBERED,
    ) -> None:
        self.controller = controller
        self.instance = instance[:128]
        self._clock = clock
        self._window = window_s
        self._max = max_remembered
        self._seen: OrderedDict[EventKey, _Seen] = OrderedDict()
        self._last_stamp = 0

    def repeat(self, key: EventKey, now: datetime) -> Repeat | None:
        """The series update for one more occurrence of ``key`` at ``now`` (UTC), or None
        when it is new (or its last occurrence is too long ago): then :meth:`new`."""
        seen = self._seen.get(key)
        if seen is None or self._clock() - seen.last > self._window:
            return None
        count = seen.count + 1
        return Repeat(seen.api_version, seen.name, count, _series(seen.api_version, count, now))

    def new(self, key: EventKey, now: datetime, api_version: str) -> NewEvent:
        """The first occurrence of ``key``: a new Event of ``api_version``."""
        return NewEvent(api_version, self._body(key, now, api_version))

    def posted(self, key: EventKey, step: NewEvent | Repeat, name: str = "") -> None:
        """``step`` succeeded; ``name`` is the created Event's (for a :class:`NewEvent`)."""
        if isinstance(step, Repeat):
            self._seen[key] = _Seen(step.api_version, step.name, step.count, self._clock())
        else:
            self._seen[key] = _Seen(step.api_version, name, 1, self._clock())
        self._seen.move_to_end(key)
        while len(self._seen) > self._max:
            self._seen.popitem(last=False)

    def forget(self, key: EventKey) -> None:
        """The Event is gone from the API (expired): the next occurrence starts anew."""
        self._seen.pop(key, None)

    def _name(self, key: EventKey, now: datetime) -> str:
        """``<object>.<nanoseconds, hex>`` like client-go's; never twice the same here."""
        stamp = max(int(now.timestamp() * 1_000_000) * 1000, self._last_stamp + 1)
        self._last_stamp = stamp
        return f"{key.name[:236]}.{stamp:x}"

    def _body(self, key: EventKey, now: datetime, api_version: str) -> dict[str, Any]:
        meta = {"name": self._name(key, now), "namespace": key.namespace}
        if api_version == EVENTS_V1:
            return {
                "apiVersion": EVENTS_V1,
                "kind": "Event",
                "metadata": meta,
                "eventTime": micro_time(now),
                "reportingController": self.controller,
                "reportingInstance": self.instance,
                "action": key.action,
                "reason": key.reason,
                "note": key.note,
                "type": key.type,
                "regarding": key.regarding(),
            }
        return {
            "apiVersion": CORE_V1,
            "kind": "Event",
            "metadata": meta,
            "involvedObject": key.regarding(),
            "type": key.type,
            "reason": key.reason,
            "action": key.action,
            "message": key.note,
            "source": {"component": self.controller},
            "reportingComponent": self.controller,
            "reportingInstance": self.instance,
            "firstTimestamp": plain_time(now),
            "lastTimestamp": plain_time(now),
            "count": 1,
        }


def _series(api_version: str, count: int, now: datetime) -> dict[str, Any]:
    if api_version == EVENTS_V1:
        return {"series": {"count": count, "lastObservedTime": micro_time(now)}}
    return {"count": count, "lastTimestamp": plain_time(now)}
