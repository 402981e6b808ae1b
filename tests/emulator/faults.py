"""Injectable API faults for the emulator: errors, expired watches and slow answers.

A test adds rules to ``api.faults`` (an :class:`ApiFaults`); each request the emulator
serves is offered to the rules in order, and the first rule that matches and still has hits
left answers it instead of the store, or delays it and lets the store answer::

    api.faults.add(ApiFault(code=500, method="PATCH", resource="v1/configmaps", times=3))
    api.faults.add(ApiFault(code=410, watch=True, resource="v1/pods", times=2))
    api.faults.add(ApiFault(delay=0.3, method="GET", times=10))   # slow, then served

``code=410`` on a watch is what an apiserver does when the watch's resourceVersion is too
old: HTTP 200, then one ``ERROR`` event whose status has code 410, then the end of the
stream.  Any other code answers with a ``Status`` error of that code.  Every hit is logged
in :attr:`ApiFaults.hits` with its time, so a test can see the client's back-off.

Pure bookkeeping; the HTTP side lives in ``tests/emulator/__init__.py``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

_REASONS = {
    409: "Conflict",
    410: "Expired",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


@dataclass
class ApiFault:
    """One rule: which requests it matches, what it does to them, how many times."""

    #: Status code to answer with (None: only ``delay``, then the request is served).
    code: int | None = None
    #: HTTP method to match ("GET", "PATCH", ...; None: any).
    method: str | None = None
    #: Resource key as in ``RESOURCES`` ("v1/configmaps"; None: any).
    resource: str | None = None
    #: Object name to match (None: any, lists and watches included).
    name: str | None = None
    #: True: only watch requests; False: only others; None: both.
    watch: bool | None = None
    #: Subresource to match ("status", "" for the main resource; None: any).
    subresource: str | None = None
    #: Requests to hit before the rule is spent.
    times: int = 1
    #: Seconds to wait before answering (or before serving, with ``code=None``).
    delay: float = 0.0
    used: int = 0

    def __post_init__(self) -> None:
        if self.code is None and self.delay <= 0:
            raise ValueError("an ApiFault needs a code, a delay, or both")
        if self.times < 1:
            raise ValueError(f"ApiFault.times must be >= 1, got {self.times}")
        if self.code is not None and not 400 <= self.code <= 599:
            raise ValueError(f"ApiFault.code must be an HTTP error (400-599), got {self.code}")

    @property
    def reason(self) -> str:
        return _REASONS.get(self.code or 0, "Injected")

    def matches(self, method: str, resource: str, name: str, watch: bool, subresource: str) -> bool:
        return (
            self.used < self.times
            and self.method in (None, method)
            and self.resource in (None, resource)
            and self.name in (None, name)
            and self.watch in (None, watch)
            and self.subresource in (None, subresource)
        )


@dataclass(frozen=True)
class Hit:
    at: float
    method: str
    resource: str
    name: str
    watch: bool
    code: int | None


@dataclass
class ApiFaults:
    """The rules and the log of what they hit; thread-safe (the store is shared)."""

    rules: list[ApiFault] = field(default_factory=list)
    hits: list[Hit] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, fault: ApiFault) -> ApiFault:
        with self._lock:
            self.rules.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def take(
        self, method: str, resource: str, name: str, watch: bool, subresource: str = ""
    ) -> ApiFault | None:
        """The rule that handles this request, counted as used; None: serve it normally."""
        with self._lock:
            for rule in self.rules:
                if rule.matches(method, resource, name, watch, subresource):
                    rule.used += 1
                    self.hits.append(
                        Hit(time.monotonic(), method, resource, name, watch, rule.code)
                    )
                    return rule
        return None

    def spent(self) -> bool:
        """Whether every rule was used up (each injected fault really happened)."""
        with self._lock:
            return all(rule.used >= rule.times for rule in self.rules)
