"""``ttlSecondsAfterFinished``: a finished job (Succeeded or Failed, an invalid one too)
is deleted once the TTL has run out; its children go with it by their ownerReferences.

Must not import: kopf, kubernetes, aiohttp.
"""

from __future__ import annotations

from typing import Any

from refit_operator.core import lifecycle
from refit_operator.core.decision import DeleteJob
from refit_operator.core.draft import Draft
from refit_operator.models import Phase


def expire(draft: Draft, raw_spec: Any, phase: Phase) -> None:
    if phase not in (Phase.SUCCEEDED, Phase.FAILED):
        return
    ttl = lifecycle.ttl_of(raw_spec)
    expiry = lifecycle.expiry(draft.status.completion_time, ttl, draft.now)
    if expiry.due:
        draft.actions.append(DeleteJob())
    elif expiry.wait_seconds is not None:
        draft.later(expiry.wait_seconds)
