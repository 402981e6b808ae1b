"""How a job that cannot run is failed, and what the apiserver's refusals of its writes
do to its status; the TTL of a finished job.

- :func:`refuse`: an invalid spec, a template that conflicts with the operator, or a child
  the apiserver refused for good (``writes.py``): phase Failed with the words that say
  why, a Warning Event, the pods stopped; a new generation of the spec starts over.
- :func:`after_writes`: every refused write reaches ``status.message``, the
  ``ChildFailure`` condition and a Warning Event with the apiserver's text.
- :func:`expire`: a finished job is deleted once ``ttlSecondsAfterFinished`` ran out.

Must not import: kopf, kubernetes, aiohttp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from refit_operator import conditions as cond
from refit_operator import lifecycle
from refit_operator.decision import (
    Action,
    Create,
    Decision,
    Delete,
    DeleteJob,
    Emit,
    JobView,
    Round,
)
from refit_operator.models import Phase
from refit_operator.observe import Observed
from refit_operator.phases import PhaseFacts, checked_next_phase
from refit_operator.writes import WriteError

#: How soon to try again after the apiserver refused a write for a reason that may pass.
RETRY_WRITE_S = 5.0


def refuse(
    job: JobView, observed: Observed, message: str, *, now: datetime, new: Phase, reason: str
) -> Decision:
    """The job cannot run as specified (``reason``: InvalidSpec, TemplateConflict, or a
    child the apiserver refused): Failed with the message, its pods stopped."""
    st = job.status
    if new is not Phase.FAILED:
        # Only a Succeeded job stays put (the table keeps it final): its pods are gone and
        # nothing is created again, so an invalid edit has nothing to act on.
        return Decision((), st.model_copy(update={"observed_generation": job.generation}))
    rnd = Round(st, job.generation, now)
    rnd.actions += [Delete("v1", "Pod", p.name) for p in observed.pods if not p.deleting]
    if st.phase is not Phase.FAILED or st.message != message:
        rnd.actions.append(Emit("Warning", reason, message))
    rnd.update(
        phase=new,
        message=message,
        observed_generation=job.generation,
        completion_time=st.completion_time or now,
    )
    rnd.condition(cond.FAILED, "True", reason, message)
    for type_ in (cond.READY, cond.RESTARTING):
        if cond.get_condition(st.conditions, type_) is not None:
            rnd.condition(type_, "False", new.value)
    expire(rnd, job.raw_spec, new)
    return Decision(tuple(rnd.actions), rnd.status, rnd.requeue)


def after_writes(
    job: JobView,
    observed: Observed,
    decision: Decision,
    errors: Sequence[WriteError],
    now: datetime,
) -> Decision:
    """``decision`` once its writes went out: what the apiserver refused reaches the
    status message, the ``ChildFailure`` condition and a Warning Event, in its own words.

    A permanent refusal of a create fails the job (reason ``ChildRejected``) until the
    spec changes; any other is retried after :data:`RETRY_WRITE_S`.  A gang whose pods
    were not all created is not recorded as created, so the next round creates the rest.
    """
    st = decision.status
    failure = cond.get_condition(st.conditions, cond.CHILD_FAILURE)
    if not errors:
        if failure is None or failure.status != "True":
            return decision
        conditions = cond.set_condition(
            st.conditions,
            cond.CHILD_FAILURE,
            "False",
            reason="Written",
            message="",
            now=now,
            generation=job.generation,
        )
        return replace(decision, status=st.model_copy(update={"conditions": conditions}))
    permanent = [e for e in errors if e.permanent]
    if permanent:
        message = f"the apiserver refused a child: {permanent[0].text()}"
        new = checked_next_phase(PhaseFacts(current=st.phase, invalid=True))
        view = replace(job, status=st)
        refused = refuse(view, observed, message, now=now, new=new, reason="ChildRejected")
        return replace(refused, actions=(*_not_creates(decision), *refused.actions))
    first = errors[0]
    message = first.text() + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
    rnd = Round(st, job.generation, now, actions=list(_not_creates(decision)))
    rnd.requeue = decision.requeue_after
    rnd.later(RETRY_WRITE_S)
    if any(e.verb == "create" and e.kind == "Pod" for e in errors):
        rnd.update(created_epoch=job.status.created_epoch)
    if failure is None or failure.status != "True" or failure.message != message:
        rnd.actions.append(Emit("Warning", first.event_reason, message))
    rnd.condition(cond.CHILD_FAILURE, "True", first.condition_reason, message)
    if st.phase not in (Phase.SUCCEEDED, Phase.FAILED):  # a final message stays
        rnd.update(message=message)
    return Decision(tuple(rnd.actions), rnd.status, rnd.requeue)


def _not_creates(decision: Decision) -> tuple[Action, ...]:
    return tuple(a for a in decision.actions if not isinstance(a, Create))


def expire(rnd: Round, raw_spec: Any, phase: Phase) -> None:
    """A finished job goes once its ``ttlSecondsAfterFinished`` has run out."""
    if phase not in (Phase.SUCCEEDED, Phase.FAILED):
        return
    expiry = lifecycle.expiry(rnd.status.completion_time, lifecycle.ttl_of(raw_spec), rnd.now)
    if expiry.due:
        rnd.actions.append(DeleteJob())
    elif expiry.wait_seconds is not None:
        rnd.later(expiry.wait_seconds)
