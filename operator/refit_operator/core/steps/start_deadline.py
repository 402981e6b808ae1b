"""``startDeadlineSeconds``: an epoch whose pods are not all Ready this long after it was
created fails like a failed pod (a restart, counted), with each late pod's reason; until
then a Pending job's message says what its pods wait for.
"""

from __future__ import annotations

from refit_operator.core import lifecycle
from refit_operator.core.draft import Draft
from refit_operator.core.phases import Outcome
from refit_operator.core.round_input import RoundInput
from refit_operator.core.steps.restart import restart_gang


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
    late = lifecycle.late_pods(inp.current, inp.absent)
    draft.waiting = lifecycle.waiting_summary(late)
    deadline = inp.spec.start_deadline_seconds
    if not late:
        return None
    if lifecycle.past(status.epoch_start_time, deadline, inp.now) is None:
        left = lifecycle.until(status.epoch_start_time, deadline, inp.now)
        if left is not None:
            draft.later(left)
        return None
    return lifecycle.start_failure(status.epoch, deadline, late)
