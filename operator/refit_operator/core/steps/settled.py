"""A finished job (Succeeded, or Failed for a reason no spec change cures) stays
finished: whatever of its gang still runs is stopped, nothing is created.
"""

from __future__ import annotations

from refit_operator.api.models import Phase
from refit_operator.core.draft import Draft
from refit_operator.core.phases import Outcome
from refit_operator.core.round_input import RoundInput


def keep_finished(inp: RoundInput, draft: Draft) -> Outcome | None:
    phase = draft.status.phase
    if phase is Phase.SUCCEEDED or (phase is Phase.FAILED and not inp.retry):
        draft.delete_pods(p for p in inp.observed.pods if p.phase not in ("Succeeded", "Failed"))
        return Outcome.SETTLED
    return None
