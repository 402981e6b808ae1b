"""The leader elector: one Lease, many operator replicas, one of them reconciling.

:meth:`Elector.acquire` returns once this replica holds the Lease (a standby waits there,
reading the Lease every retry period); :meth:`Elector.hold` renews it and returns only
when it is lost (raising :class:`LeaseLost`), and the caller must stop reconciling at
once: the operator process exits, and its Deployment starts it again as a standby.
:meth:`Elector.release` gives the Lease up on a clean shutdown, so a standby need not wait
for it to expire.  The decisions are in ``lease``; every API call here has a deadline, so
a hung request can never keep a leader working past its renew deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from refit_operator.shell import kube
from refit_operator.shell.lease import (
    API_VERSION,
    KIND,
    Move,
    Record,
    Timing,
    decide,
    next_record,
    released,
)

log = logging.getLogger(__name__)


class LeaseLost(Exception):
    """This replica no longer holds the Lease: it must stop reconciling now."""


def default_identity() -> str:
    """The pod's name (``POD_NAME`` from the downward API, else the host name) and a
    random suffix, so a restarted container never mistakes its predecessor's Lease for
    its own (controller-runtime does the same)."""
    base = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}_{uuid.uuid4()}"


class Elector:
    """One candidate for the Lease ``namespace/name``."""

    def __init__(
        self,
        api: kube.Kube,
        *,
        namespace: str,
        name: str,
        identity: str,
        timing: Timing,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._api = api
        self.namespace, self.name, self.identity = namespace, name, identity
        self.timing = timing
        self._clock, self._wall = clock, wall
        self._observed: Record | None = None
        self._observed_at = float("-inf")
        self.leading = False
        #: When (our clock) the last attempt that renewed the Lease began.
        self.renewed_at = float("-inf")
        #: When (our clock) the API last answered an attempt.
        self.answered_at = float("-inf")
        self.holder = ""

    def valid(self) -> bool:
        """This replica leads and renewed within the renew deadline (by its own clock):
        checked before every reconcile round, so even a loop that was blocked past the
        deadline cannot write once more before :meth:`hold` notices."""
        return self.leading and self._clock() - self.renewed_at < self.timing.renew_deadline

    def in_touch(self) -> bool:
        """The API answered within a lease duration: this replica can lead or take over."""
        return self._clock() - self.answered_at <= self.timing.lease_duration

    async def acquire(self) -> None:
        """Return once this replica holds the Lease; until then, a standby."""
        log.info(
            "leader election: %s is a candidate for Lease %s/%s",
            self.identity,
            self.namespace,
            self.name,
        )
        while not await self._attempt(self.timing.retry_period):
            # A little jitter keeps standbys from racing in lock step (client-go's too).
            await asyncio.sleep(self.timing.retry_period * random.uniform(1.0, 1.2))
        log.info(
            "leader election: %s now leads (Lease %s/%s)", self.identity, self.namespace, self.name
        )

    async def hold(self) -> None:
        """Renew the Lease every retry period; raise :class:`LeaseLost` when it is lost:
        not renewed for the renew deadline, or found held by another replica."""
        while True:
            await asyncio.sleep(self.timing.retry_period)
            while True:
                left = self.renewed_at + self.timing.renew_deadline - self._clock()
                if left <= 0:
                    self.leading = False
                    raise LeaseLost(
                        f"the Lease {self.namespace}/{self.name} was not renewed for "
                        f"{self.timing.renew_deadline:g} s"
                    )
                if await self._attempt(left):
                    break
                if not self.leading:
                    holder = self.holder or "nobody"
                    raise LeaseLost(f"the Lease {self.namespace}/{self.name} is held by {holder}")
                await asyncio.sleep(min(self.timing.retry_period, max(left, 0.0)))

    async def release(self) -> None:
        """Give the Lease up (on a clean shutdown), if this replica still holds it."""
        if not self.leading:
            return
        self.leading = False
        try:
            await asyncio.wait_for(self._release(), timeout=self.timing.retry_period)
        except (TimeoutError, kube.ApiError, OSError) as exc:
            log.warning("leader election: could not release the Lease: %s", exc)

    async def _release(self) -> None:
        lease = await self._api.get(API_VERSION, KIND, self.namespace, self.name)
        if lease is None or Record.of(lease).holder != self.identity:
            return  # not ours any more: nothing to give up
        patch = {
            "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
            "spec": released(Record.of(lease), self._wall()).spec(),
        }
        await self._api.merge_patch(API_VERSION, KIND, self.namespace, self.name, patch)
        log.info("leader election: %s released the Lease", self.identity)

    async def _attempt(self, timeout: float) -> bool:
        """One try to take or renew, within ``timeout`` seconds; True when we hold it."""
        started = self._clock()
        try:
            held = await asyncio.wait_for(self._try(), timeout=timeout)
        except kube.ConflictError:  # another candidate wrote first; the next read tells
            held = False
        except (TimeoutError, kube.ApiError, OSError) as exc:
            log.warning("leader election: the Lease could not be read or written: %s", exc)
            return False
        self.answered_at = self._clock()
        if held:
            self.renewed_at = started
        return held

    async def _try(self) -> bool:
        lease = await self._api.get(API_VERSION, KIND, self.namespace, self.name)
        record = Record.of(lease) if lease is not None else None
        now = self._clock()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        if record is not None and record.holder != self.holder:
            if record.holder:
                log.info("leader election: the Lease is held by %s", record.holder)
            self.holder = record.holder
        move = decide(record, identity=self.identity, observed_at=self._observed_at, now=now)
        if move is Move.WAIT:
            self.leading = False
            return False
        new = next_record(
            move, record, identity=self.identity, timing=self.timing, now=self._wall()
        )
        if lease is None:
            body = {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": new.spec(),
            }
            if not await self._api.create(body):
                return False  # another candidate created it first
        else:
            patch = {
                "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                "spec": new.spec(),
            }
            await self._api.merge_patch(API_VERSION, KIND, self.namespace, self.name, patch)
        self._observed, self._observed_at, self.holder = new, now, self.identity
        self.leading = True
        return True
