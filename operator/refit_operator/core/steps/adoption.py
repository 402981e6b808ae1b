"""Pods of the epoch exist, yet the status does not say so: the write that recorded their
creation was lost (a 409), or some of the creates were refused.  They are the gang (the
rendezvous was cleared before they were created, and clearing it again would drop what
they published), so the status records them; those still missing are created into the
same epoch while the barrier is closed, since no rank has moved a byte yet.
"""

from __future__ import annotations

from refit_operator.core.decision import Create
from refit_operator.core.draft import Draft
from refit_operator.core.round_input import RoundInput
from refit_operator.render import pods


def adopt_unrecorded_gang(inp: RoundInput, draft: Draft) -> None:
    if inp.adopted:
        status = draft.status
        draft.update(
            created_epoch=status.epoch,
            start_time=status.start_time or inp.now,
            epoch_start_time=status.epoch_start_time or inp.now,
        )


def create_the_missing_pods(inp: RoundInput, draft: Draft) -> None:
    if inp.fills_adopted_gang:
        status = draft.status
        gang = pods.render_gang(
            inp.job.ref, inp.spec, status.epoch, inp.options, status.refits_completed, rollout={}
        )
        missing = set(inp.policy_absent)
        draft.actions.extend(Create(p) for p in gang if p["metadata"]["name"] in missing)
