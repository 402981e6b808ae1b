"""Why a job failed, said in one place: every way into phase Failed (a policy step of the
round, a refused spec or child, a pod ``refit run`` cannot start) ends in
:func:`mark_failed`, which writes ``status.message`` and the ``Failed`` condition from one
:class:`Failure`, and never without words.

A step that fails the job says why with :meth:`~refit_operator.core.draft.Draft.fail`.
Should a round end Failed without that (a step that forgot, a stored Failed status
whose message was lost or written empty), :func:`why_failed` takes what the status
recorded, else builds the words from what the round sees: the pods' own failures and
disruptions, and each limit with what is used of it.  A message left over from an
earlier round (a restart's, a preemption's) is never taken for the cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from refit_operator.api.models import Phase, RefitJobStatus
from refit_operator.core import conditions as cond
from refit_operator.core.round_input import RoundInput

if TYPE_CHECKING:  # the draft holds a Failure: only its type is needed here
    from refit_operator.core.draft import Draft

#: The Failed condition's reason when nothing but the round's facts say why.
UNRECORDED = "FailureUnrecorded"
#: Causes named in a message built from the facts; past this many, the rest are counted.
MAX_CAUSES = 3


@dataclass(frozen=True)
class Failure:
    """The Failed condition's reason (CamelCase) and the words that name the cause."""

    reason: str
    message: str


def mark_failed(draft: Draft, failure: Failure) -> None:
    """``draft`` as Failed because of ``failure``: phase, message, the Failed condition and
    the completion time (the first one, when it was failed before)."""
    message = failure.message.strip() or f"{failure.reason} (no detail was given)"
    draft.update(
        phase=Phase.FAILED,
        message=message,
        completion_time=draft.status.completion_time or draft.now,
    )
    draft.condition(cond.FAILED, "True", failure.reason, message)


def recorded(status: RefitJobStatus) -> Failure | None:
    """What a status already Failed says about why (its message, else its Failed
    condition's; '' when neither says), or None when it is not Failed."""
    if status.phase is not Phase.FAILED:
        return None
    found = cond.get_condition(status.conditions, cond.FAILED)
    condition = found if found is not None and found.status == "True" else None
    if condition is None:
        return Failure(UNRECORDED, status.message)
    return Failure(condition.reason, status.message or condition.message)


def why_failed(inp: RoundInput, draft: Draft) -> Failure:
    """Why a round that ends Failed failed: the step's words, else the status's record,
    else the round's facts (under the recorded reason, if there is one)."""
    if draft.failure is not None and draft.failure.message.strip():
        return draft.failure
    stored = recorded(draft.status)
    if stored is not None and stored.message.strip():
        return stored
    reason = stored.reason if stored is not None else UNRECORDED
    return Failure(reason, from_facts(inp, draft.status))


def from_facts(inp: RoundInput, status: RefitJobStatus) -> str:
    """The causes the round sees (pods that failed, pods taken away) and every limit with
    what is used of it."""
    rollout = [s.pod.failure for s in inp.slots if s.pod is not None and s.pod.failure]
    causes = [*inp.failures, *rollout, *inp.disruptions]
    named = "; ".join(causes[:MAX_CAUSES]) or "no pod of the job failed or was taken away"
    more = len(causes) - MAX_CAUSES
    limits = (
        f"restarts {status.restarts}/{inp.spec.failure_policy.max_restarts} used, "
        f"rollout replacements {status.rollout_failures}/"
        f"{inp.spec.rollout_failure_policy.max_replacements} used"
    )
    rest = f"; and {more} more" if more > 0 else ""
    return f"failed without a recorded cause: {named}{rest} ({limits})"
