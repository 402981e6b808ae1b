"""The time limits of a RefitJob, in one place: the policy steps that enforce them, and
what its pods are waiting for.

- ``activeDeadlineSeconds`` (:func:`active_deadline`): the job fails and its pods stop once
  it has run this long since it started (a suspend resets the start, as for a Job); until
  then the round asks to look again when it runs out.
- ``startDeadlineSeconds`` (:func:`fail_late_start`): an epoch whose pods are not all Ready
  this long after it was created fails like a failed pod (a restart, counted), with each
  late pod's reason (ImagePullBackOff, Unschedulable with the scheduler's words, a pod
  that could not be created, ...); until then a Pending job's message says what its pods
  wait for.
- ``ttlSecondsAfterFinished`` (:func:`expire`, after the round's stages): a finished job
  (Succeeded or Failed, an invalid one too) is deleted this long after it ended; its
  children go with it by their ownerReferences.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from refit_operator.api.models import Phase
from refit_operator.core.decision import DeleteJob
from refit_operator.core.draft import Draft
from refit_operator.core.observe import ObservedPod
from refit_operator.core.phases import Outcome
from refit_operator.core.round_input import RoundInput
from refit_operator.core.steps.restart import restart_gang

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


# -- activeDeadlineSeconds ------------------------------------------------------------


def active_deadline(inp: RoundInput, draft: Draft) -> Outcome | None:
    limit = inp.spec.active_deadline_seconds
    start = draft.status.start_time
    if past(start, limit, inp.now) is None:
        left = until(start, limit, inp.now)
        if left is not None:
            draft.later(left)
        return None
    draft.delete_pods(inp.observed.pods)
    draft.fail("DeadlineExceeded", f"the job ran past activeDeadlineSeconds ({limit} s)")
    return Outcome.DEADLINE_EXCEEDED


# -- startDeadlineSeconds -------------------------------------------------------------


def fail_late_start(inp: RoundInput, draft: Draft) -> Outcome | None:
    late = _late_start(inp, draft)
    if late is None or inp.failures:
        return None  # a pod's own failure says more than its lateness
    return restart_gang(
        inp, draft, failures=[late], disruptions=inp.disruptions, reason="StartDeadlineExceeded"
    )


def _late_start(inp: RoundInput, draft: Draft) -> str | None:
    """The start-deadline failure of the epoch if its time is up, else None (and the
    Pending message says what the pods wait for)."""
    status = draft.status
    if status.ready_epoch == status.epoch or status.epoch_start_time is None:
        return None
    late = late_pods(inp.current, inp.absent)
    draft.waiting = waiting_summary(late)
    deadline = inp.spec.start_deadline_seconds
    if not late:
        return None
    if past(status.epoch_start_time, deadline, inp.now) is None:
        left = until(status.epoch_start_time, deadline, inp.now)
        if left is not None:
            draft.later(left)
        return None
    return start_failure(status.epoch, deadline, late)


# -- ttlSecondsAfterFinished ----------------------------------------------------------


def expire(draft: Draft, ttl: int | None, phase: Phase) -> None:
    """``ttl``: the spec's ``ttlSecondsAfterFinished`` (``JobView.basics``: read also of a
    spec that is otherwise invalid)."""
    if phase not in (Phase.SUCCEEDED, Phase.FAILED):
        return
    due = expiry(draft.status.completion_time, ttl, draft.now)
    if due.due:
        draft.actions.append(DeleteJob())
    elif due.wait_seconds is not None:
        draft.later(due.wait_seconds)
