"""The job succeeds when its gang's work is over and every rollout rank reported every
refit committed (``progress.finished``); what still runs of the gang is stopped.
"""

from __future__ import annotations

from refit_operator.core.draft import Draft
from refit_operator.core.phases import Outcome
from refit_operator.core.round_input import RoundInput


def succeed_when_done(inp: RoundInput, draft: Draft) -> Outcome | None:
    if not inp.over or inp.short is not None:
        return None
    draft.update(completion_time=inp.now)
    draft.delete_pods(p for p in inp.observed.pods if p.phase not in ("Succeeded", "Failed"))
    return Outcome.ALL_ROLLOUTS_DONE
