"""``activeDeadlineSeconds``: a job that ran this long since it started fails and its pods
stop, as a Job's do; until then the round asks to look again when it runs out.
"""

from __future__ import annotations

from refit_operator.core import lifecycle
from refit_operator.core.draft import Draft
from refit_operator.core.phases import Outcome
from refit_operator.core.round_input import RoundInput


def active_deadline(inp: RoundInput, draft: Draft) -> Outcome | None:
    limit = inp.spec.active_deadline_seconds
    start = draft.status.start_time
    if lifecycle.past(start, limit, inp.now) is None:
        left = lifecycle.until(start, limit, inp.now)
        if left is not None:
            draft.later(left)
        return None
    draft.delete_pods(inp.observed.pods)
    draft.fail("DeadlineExceeded", f"the job ran past activeDeadlineSeconds ({limit} s)")
    return Outcome.DEADLINE_EXCEEDED
