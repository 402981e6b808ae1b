"""How a job that cannot run is failed: an invalid spec, a template that conflicts with
the operator, or a child the apiserver refused for good (``write_refusals.py``).  Phase
Failed with the words that say why, a Warning Event, the pods stopped; a new generation of
the spec starts over (``steps/validity.py``).
"""

from __future__ import annotations

from datetime import datetime

from refit_operator.api.models import Phase, RefitJobStatus
from refit_operator.core import conditions as cond
from refit_operator.core.decision import Decision, Emit, JobView
from refit_operator.core.draft import Draft
from refit_operator.core.failure import Failure, mark_failed
from refit_operator.core.observe import Observed
from refit_operator.core.phases import PhaseFacts, checked_next_phase
from refit_operator.core.steps import time_limits


def refuse(
    job: JobView, observed: Observed, message: str, *, now: datetime, reason: str
) -> Decision:
    """The job cannot run as specified (``reason``: InvalidSpec, TemplateConflict, or a
    child the apiserver refused): Failed with the message, its pods stopped."""
    status = job.status
    new = checked_next_phase(PhaseFacts(current=status.phase, invalid=True))
    if new is not Phase.FAILED:
        # Only a Succeeded job stays put (the table keeps it final): its pods are gone and
        # nothing is created again, so an invalid edit has nothing to act on.
        return Decision((), status.model_copy(update={"observed_generation": job.generation}))
    draft = Draft(status, job.generation, now)
    draft.delete_pods(observed.pods)
    draft.update(observed_generation=job.generation)
    mark_failed(draft, Failure(reason, message))
    said = draft.status.message  # the words mark_failed wrote, never empty
    if status.phase is not Phase.FAILED or status.message != said:
        draft.actions.append(Emit("Warning", reason, said))
    for type_ in (cond.READY, cond.RESTARTING):
        if cond.get_condition(status.conditions, type_) is not None:
            draft.condition(type_, "False", new.value)
    time_limits.expire(draft, job.basics.ttl_seconds_after_finished, new)
    return draft.decision()


def failed_status(
    status: RefitJobStatus, failure: Failure, *, generation: int, now: datetime
) -> RefitJobStatus:
    """``status`` Failed because of ``failure``, said as every Failed is (``failure.py``):
    for a shell that fails a job outside a round (``refit run``: a pod that cannot start)."""
    draft = Draft(status, generation, now)
    mark_failed(draft, failure)
    return draft.status
