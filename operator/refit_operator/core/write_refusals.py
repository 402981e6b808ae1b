"""What the apiserver's refusals of a round's writes do to the job's status: every refused
write reaches ``status.message``, the ``ChildFailure`` condition and a Warning Event, in
the apiserver's own words (``writes.py`` holds the refusal as data).

A permanent refusal of a create fails the job (reason ``ChildRejected``) until the spec
changes; any other is retried after :data:`RETRY_WRITE_S`.  A gang whose pods were not
all created is not recorded as created (nor a rollout slot whose pod was refused), so the
next round creates the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from refit_operator.api.models import Phase
from refit_operator.core import conditions as cond
from refit_operator.core.decision import Action, Create, Decision, Emit, JobView
from refit_operator.core.draft import Draft
from refit_operator.core.observe import Observed
from refit_operator.core.refusal import refuse
from refit_operator.core.writes import WriteError

#: How soon to try again after the apiserver refused a write for a reason that may pass.
RETRY_WRITE_S = 5.0


def after_writes(
    job: JobView,
    observed: Observed,
    decision: Decision,
    errors: Sequence[WriteError],
    now: datetime,
) -> Decision:
    """``decision`` once its writes went out (``job`` as it was read this round)."""
    status = decision.status
    failure = cond.get_condition(status.conditions, cond.CHILD_FAILURE)
    if not errors:
        if failure is None or failure.status != "True":
            return decision
        conditions = cond.set_condition(
            status.conditions,
            cond.CHILD_FAILURE,
            "False",
            reason="Written",
            message="",
            now=now,
            generation=job.generation,
        )
        return replace(decision, status=status.model_copy(update={"conditions": conditions}))
    permanent = [e for e in errors if e.permanent]
    if permanent:
        message = f"the apiserver refused a child: {permanent[0].text()}"
        view = replace(job, status=status)
        refused = refuse(view, observed, message, now=now, reason="ChildRejected")
        return replace(refused, actions=(*_not_creates(decision), *refused.actions))
    first = errors[0]
    message = first.text() + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
    draft = Draft(status, job.generation, now, actions=list(_not_creates(decision)))
    draft.requeue = decision.requeue_after
    draft.later(RETRY_WRITE_S)
    unmade = {e.name for e in errors if e.verb == "create" and e.kind == "Pod"}
    if unmade:  # a rollout slot whose pod was refused is to be created, not replaced
        replicas = [
            r.model_copy(update={"pod": ""}) if r.pod in unmade else r
            for r in status.rollout_replicas
        ]
        draft.update(created_epoch=job.status.created_epoch, rollout_replicas=replicas)
    if failure is None or failure.status != "True" or failure.message != message:
        draft.actions.append(Emit("Warning", first.event_reason, message))
    draft.condition(cond.CHILD_FAILURE, "True", first.condition_reason, message)
    if status.phase not in (Phase.SUCCEEDED, Phase.FAILED):  # a final message stays
        draft.update(message=message)
    return draft.decision()


def _not_creates(decision: Decision) -> tuple[Action, ...]:
    return tuple(a for a in decision.actions if not isinstance(a, Create))
