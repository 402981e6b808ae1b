"""Leader election on a ``coordination.k8s.io/v1`` Lease: the decisions, as client-go makes
them (``k8s.io/client-go/tools/leaderelection``), so kube-refit's replicas and any tool
that reads Leases agree on who leads.

- A candidate that finds no Lease creates it, naming itself.
- A Lease held by another candidate is valid until ``leaseDurationSeconds`` have passed
  since this candidate last *saw it change*, by this candidate's own clock: clocks of
  different machines are never compared, only durations.
- A Lease that is not valid, or released (no holder), is taken: holder, acquire and renew
  times are rewritten, and ``leaseTransitions`` goes up by one.
- The leader renews (a new ``renewTime``) every retry period; one that has not renewed for
  ``renew_deadline`` seconds has lost, and stops at once.  As ``renew_deadline`` <
  ``lease_duration``, it has stopped before any other candidate may take the Lease.
- Every write is conditional on the ``resourceVersion`` read, so of two candidates that
  race, one wins and the other gets HTTP 409.

Pure: no I/O and no clock of its own (``leader`` does the API calls).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from refit_operator.shell.events import micro_time

API_VERSION = "coordination.k8s.io/v1"
KIND = "Lease"
#: client-go's (and controller-runtime's) defaults.
LEASE_DURATION_S = 15.0
RENEW_DEADLINE_S = 10.0
RETRY_PERIOD_S = 2.0
#: The renew deadline must leave at least this many retry periods of slack (client-go).
JITTER_FACTOR = 1.2


@dataclass(frozen=True, kw_only=True)
class Timing:
    """How long a Lease lasts, how long its leader keeps trying to renew, how often."""

    lease_duration: float = LEASE_DURATION_S
    renew_deadline: float = RENEW_DEADLINE_S
    retry_period: float = RETRY_PERIOD_S

    def __post_init__(self) -> None:
        for name in ("lease_duration", "renew_deadline", "retry_period"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"leader election: {name} must be a number > 0, got {value}")
        if self.lease_duration < 1:
            raise ValueError(
                "leader election: the lease duration must be at least 1 s (the Lease holds "
                f"whole seconds), got {self.lease_duration}"
            )
        if self.lease_duration <= self.renew_deadline:
            raise ValueError(
                f"leader election: the lease duration ({self.lease_duration} s) must be longer "
                f"than the renew deadline ({self.renew_deadline} s), or a standby could take "
                "the Lease while the leader still works"
            )
        if self.renew_deadline <= JITTER_FACTOR * self.retry_period:
            raise ValueError(
                f"leader election: the renew deadline ({self.renew_deadline} s) must be longer "
                f"than {JITTER_FACTOR} x the retry period ({self.retry_period} s)"
            )

    @property
    def lease_seconds(self) -> int:
        """``spec.leaseDurationSeconds`` (whole seconds, rounded up)."""
        return math.ceil(self.lease_duration)


@dataclass(frozen=True)
class Record:
    """The election record of a Lease's spec (times as the API wrote them)."""

    holder: str = ""
    lease_seconds: int = 0
    acquire_time: str = ""
    renew_time: str = ""
    transitions: int = 0

    @classmethod
    def of(cls, lease: Mapping[str, Any]) -> Record:
        spec = lease.get("spec") or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            lease_seconds=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=str(spec.get("acquireTime") or ""),
            renew_time=str(spec.get("renewTime") or ""),
            transitions=int(spec.get("leaseTransitions") or 0),
        )

    def spec(self) -> dict[str, Any]:
        return {
            "holderIdentity": self.holder or None,
            "leaseDurationSeconds": self.lease_seconds,
            "acquireTime": self.acquire_time or None,
            "renewTime": self.renew_time or None,
            "leaseTransitions": self.transitions,
        }


class Move(enum.Enum):
    CREATE = "create"  # no Lease yet
    WAIT = "wait"  # another candidate holds a valid Lease
    TAKE = "take"  # the Lease is free or expired: write ourselves in
    RENEW = "renew"  # we hold it: write a new renew time


def decide(
    record: Record | None,
    *,
    identity: str,
    observed_at: float,
    now: float,
) -> Move:
    """What candidate ``identity`` does next, given the Lease's record (None: no Lease)
    and when (by its own clock) it saw that record change last."""
    if record is None:
        return Move.CREATE
    if record.holder == identity:
        return Move.RENEW
    if record.holder and now < observed_at + record.lease_seconds:
        return Move.WAIT
    return Move.TAKE


def next_record(
    move: Move, old: Record | None, *, identity: str, timing: Timing, now: datetime
) -> Record:
    """The record a CREATE, TAKE or RENEW writes at wall time ``now`` (UTC)."""
    stamp = micro_time(now)
    if move is Move.RENEW and old is not None:
        return Record(
            identity, timing.lease_seconds, old.acquire_time or stamp, stamp, old.transitions
        )
    if move is Move.TAKE and old is not None:
        return Record(identity, timing.lease_seconds, stamp, stamp, old.transitions + 1)
    if move is Move.CREATE:
        return Record(identity, timing.lease_seconds, stamp, stamp, 0)
    raise ValueError(f"no record to write for {move.value}")


def released(old: Record, now: datetime) -> Record:
    """What a leader that stops on purpose writes: no holder, so a standby takes over at
    its next try instead of waiting a whole lease duration (client-go's release)."""
    stamp = micro_time(now)
    return Record("", 1, stamp, stamp, old.transitions)
