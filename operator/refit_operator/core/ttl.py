"""``ttlSecondsAfterFinished``: a finished job (Succeeded or Failed, an invalid one too)
is deleted once the TTL has run out; its children go with it by their ownerReferences.
"""

from __future__ import annotations

from refit_operator.api.models import Phase
from refit_operator.core import lifecycle
from refit_operator.core.decision import DeleteJob
from refit_operator.core.draft import Draft


def expire(draft: Draft, ttl: int | None, phase: Phase) -> None:
    """``ttl``: the spec's ``ttlSecondsAfterFinished`` (``JobView.basics``: read also of a
    spec that is otherwise invalid)."""
    if phase not in (Phase.SUCCEEDED, Phase.FAILED):
        return
    expiry = lifecycle.expiry(draft.status.completion_time, ttl, draft.now)
    if expiry.due:
        draft.actions.append(DeleteJob())
    elif expiry.wait_seconds is not None:
        draft.later(expiry.wait_seconds)
