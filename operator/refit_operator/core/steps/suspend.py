"""``spec.suspend``: the gang stops and nothing is created (what exists from before, the
Services and the rendezvous ConfigMap, stays).
"""

from __future__ import annotations

from refit_operator.api.models import Phase
from refit_operator.core.draft import Draft
from refit_operator.core.phases import Outcome
from refit_operator.core.round_input import RoundInput
from refit_operator.core.steps.restart import drop_pod_group, reset_slots


def suspend(inp: RoundInput, draft: Draft) -> Outcome | None:
    if not inp.spec.suspend:
        return None
    if draft.status.phase is not Phase.SUSPENDED:
        # A new epoch on resume keeps the suspended gang's rendezvous entries stale; the
        # active deadline starts again on resume, as a Job's does.
        drop_pod_group(inp, draft)
        draft.update(
            epoch=draft.status.epoch + 1,
            created_epoch=None,
            restart_at=None,
            epoch_start_time=None,
            start_time=None,
        )
        reset_slots(inp, draft, None)  # every rollout pod stops too: new names on resume
    draft.delete_pods(inp.observed.pods)
    return Outcome.SUSPENDED
