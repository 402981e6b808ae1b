"""Creating the epoch's gang: pods of older incarnations are deleted first, and the policy
gang is created only once the older policy pods are gone (or lost with their node), the
rendezvous is cleared of all but the entries of the rollout replicas that keep running,
and the restart's backoff is over (what the stopped gang reported meanwhile is still
counted).  Rollout slots without a pod come with it.
"""

from __future__ import annotations

from refit_operator.core import failure_domain, progress
from refit_operator.core.coordinate import clear
from refit_operator.core.draft import Draft
from refit_operator.core.phases import Outcome
from refit_operator.core.round_input import RoundInput
from refit_operator.core.steps.restart import POLL_DELETING_S
from refit_operator.core.steps.rollout_replicas import due, rollout_pods


def delete_old_epochs(inp: RoundInput, draft: Draft) -> None:
    draft.delete_pods(inp.stale)


def create_gang(inp: RoundInput, draft: Draft) -> Outcome | None:
    if inp.created:
        return None
    draft.status = progress.fold_previous_epoch(draft.status, inp.spec, inp.observed)
    status = draft.status
    if any(p.role == "policy" and p.node_lost is None for p in inp.stale):
        draft.later(POLL_DELETING_S)
        return Outcome.WAITING_FOR_GANG if status.epoch > 0 else Outcome.NOT_READY
    serving = frozenset(s.pod.uid for s in inp.slots if s.pod is not None and s.pod.uid)
    stale_data = clear(inp.observed.rendezvous, serving)
    if stale_data:  # old pods are gone: drop their entries before new ones arrive
        draft.actions.extend(stale_data)
        draft.later(POLL_DELETING_S)
        return Outcome.WAITING_FOR_GANG if status.epoch > 0 else Outcome.NOT_READY
    wait = failure_domain.policy_gang(status).waits(inp.now)
    if wait is not None:  # the restart's backoff still runs
        draft.later(wait)
        return Outcome.WAITING_FOR_GANG
    draft.actions.extend(rollout_pods(inp, draft, due(inp, draft), policy=True))
    draft.update(
        created_epoch=status.epoch,
        restart_at=None,
        start_time=status.start_time or inp.now,
        epoch_start_time=status.epoch_start_time or inp.now,
    )
    draft.later(float(inp.spec.start_deadline_seconds))
    return Outcome.NOT_READY
