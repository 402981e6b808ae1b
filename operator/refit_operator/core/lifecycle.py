"""Time limits of a RefitJob and what its pods are waiting for (pure decisions).

- ``startDeadlineSeconds``: an epoch whose pods are not all Ready this long after its first
  pod was created fails, with each late pod's reason (ImagePullBackOff, Unschedulable with
  the scheduler's words, a pod that could not be created, ...).
- ``activeDeadlineSeconds``: the job fails once it has run this long since it started
  (a suspend resets the start, as for a Job).
- ``ttlSecondsAfterFinished``: a finished job is deleted this long after it ended; its
  children go with it (ownerReferences).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from refit_operator.core.observe import ObservedPod

#: Late pods named in a start-deadline message; past this many, the rest are counted.
MAX_NAMED = 4


@dataclass(frozen=True)
class Expiry:
    """Whether a finished job's TTL has run out, else how long until it does."""

    due: bool
    wait_seconds: float | None = None


def expiry(completion: datetime | None, ttl: int | None, now: datetime) -> Expiry:
    if completion is None or ttl is None:
        return Expiry(False)
    left = (completion + timedelta(seconds=ttl) - now).total_seconds()
    return Expiry(True) if left <= 0 else Expiry(False, left)


def past(start: datetime | None, seconds: int | None, now: datetime) -> float | None:
    """None while ``start + seconds`` is still ahead (or unset); else how far past it is."""
    if start is None or seconds is None:
        return None
    over = (now - start - timedelta(seconds=seconds)).total_seconds()
    return over if over >= 0 else None


def until(start: datetime | None, seconds: int | None, now: datetime) -> float | None:
    """Seconds until ``start + seconds`` (None: unset or already past)."""
    if start is None or seconds is None:
        return None
    left = (start + timedelta(seconds=seconds) - now).total_seconds()
    return left if left > 0 else None


def late_pods(current: Sequence[ObservedPod], missing: Iterable[str]) -> list[str]:
    """Each pod of the epoch that is not Ready, with why, in name order."""
    lines = [f"{name}: not created" for name in missing]
    for pod in current:
        if pod.ready or pod.phase == "Succeeded":
            continue
        lines.append(f"{pod.name}: {pod.waiting or pod.phase}")
    return sorted(lines)


def start_failure(epoch: int, deadline: int, late: Sequence[str]) -> str:
    named = "; ".join(late[:MAX_NAMED])
    more = len(late) - MAX_NAMED
    rest = f"; and {more} more" if more > 0 else ""
    return f"epoch {epoch} did not start within startDeadlineSeconds ({deadline} s): {named}{rest}"


def waiting_summary(late: Sequence[str]) -> str:
    """What a Pending job shows as its message: the first late pods and why."""
    if not late:
        return ""
    more = len(late) - MAX_NAMED
    return "waiting for " + "; ".join(late[:MAX_NAMED]) + (f"; and {more} more" if more > 0 else "")
