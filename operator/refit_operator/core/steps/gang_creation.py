"""Creating the epoch's gang: pods of older epochs are deleted first, and the gang is
created only once they are gone, their rendezvous entries are cleared and the restart's
backoff is over (what the stopped gang reported meanwhile is still counted).

Must not import: kopf, kubernetes, aiohttp.
"""

from __future__ import annotations

from refit_operator import render
from refit_operator.core import progress
from refit_operator.core.coordinate import clear
from refit_operator.core.decision import Create
from refit_operator.core.draft import Draft
from refit_operator.core.phases import Finding
from refit_operator.core.round_input import RoundInput
from refit_operator.core.steps.restart import POLL_DELETING_S


def delete_old_epochs(inp: RoundInput, draft: Draft) -> Finding | None:
    draft.delete_pods(inp.stale)
    return None


def create_gang(inp: RoundInput, draft: Draft) -> Finding | None:
    if inp.created:
        return None
    draft.status = progress.fold_previous_epoch(draft.status, inp.spec, inp.observed)
    status = draft.status
    if inp.stale:
        draft.later(POLL_DELETING_S)
        return "waiting_for_gang" if status.epoch > 0 else "not_ready"
    stale_data = clear(inp.observed.rendezvous)
    if stale_data:  # old pods are gone: drop their entries before new ones arrive
        draft.actions.extend(stale_data)
        draft.later(POLL_DELETING_S)
        return "waiting_for_gang" if status.epoch > 0 else "not_ready"
    if status.restart_at is not None and inp.now < status.restart_at:
        draft.later((status.restart_at - inp.now).total_seconds())
        return "waiting_for_gang"
    pods = render.render_gang(
        inp.job.ref, inp.spec, status.epoch, inp.options, status.refits_completed
    )
    draft.actions.extend(Create(p) for p in pods)
    draft.update(
        created_epoch=status.epoch,
        restart_at=None,
        start_time=status.start_time or inp.now,
        epoch_start_time=status.epoch_start_time or inp.now,
    )
    draft.later(float(inp.spec.start_deadline_seconds))
    return "not_ready"
