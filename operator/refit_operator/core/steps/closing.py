"""The end of every round that got past the spec check: the conditions that follow from
the new phase, the phase itself, the message it shows, the role counts (with
``RolloutDegraded``), and an Event for a phase move.  A Failed job's message and Failed
condition come from ``failure.why_failed``, so neither is ever empty.
"""

from __future__ import annotations

from typing import Literal

from refit_operator.api.models import Phase, RoleStatus
from refit_operator.core import conditions as cond
from refit_operator.core.decision import Emit
from refit_operator.core.draft import Draft
from refit_operator.core.failure import mark_failed, why_failed
from refit_operator.core.round_input import RoundInput


def close_round(inp: RoundInput, draft: Draft, *, old: Phase, new: Phase) -> None:
    _phase_conditions(draft, old=old, new=new)
    if new is Phase.FAILED:
        # Every round of a Failed job, the one that failed it and each after: a message
        # lost or written empty is said again from what is known.
        mark_failed(draft, why_failed(inp, draft))
        message = draft.status.message
    elif new is Phase.RESTARTING:
        message = draft.status.message
    elif new is Phase.PENDING:
        message = draft.waiting
    else:
        message = ""
    draft.update(
        phase=new,
        message=message,
        observed_generation=inp.job.generation,
        **_role_counts(inp, draft),
    )
    _degraded(inp, draft, new)
    if new is not old:
        kind: Literal["Normal", "Warning"] = "Warning" if new is Phase.FAILED else "Normal"
        text = f"phase {old.value} -> {new.value}" + (f": {message}" if message else "")
        draft.actions.append(Emit(kind, new.value, text))


def _role_counts(inp: RoundInput, draft: Draft) -> dict[str, RoleStatus]:
    """Each role's pods of the incarnation the status now names (a restart's new epoch,
    a replaced replica's new generation): Ready, existing, and asked for."""
    status = draft.status
    generation = {r.rank: r.generation for r in status.rollout_replicas}
    live = [p for p in inp.observed.pods if not p.deleting]
    policy = [p for p in live if p.role == "policy" and p.epoch == status.epoch]
    rollout = [p for p in live if p.role == "rollout" and generation.get(p.rank) == p.generation]
    return {
        "policy": RoleStatus(
            ready=sum(p.ready for p in policy),
            total=len(policy),
            desired=inp.spec.policy.replicas,
        ),
        "rollout": RoleStatus(
            ready=sum(p.ready for p in rollout),
            total=len(rollout),
            desired=inp.spec.rollout.replicas,
            replacements=status.rollout.replacements,
        ),
    }


def _degraded(inp: RoundInput, draft: Draft, new: Phase) -> None:
    """RolloutDegraded: fewer rollout replicas serve than asked, once the job ran."""
    rollout = draft.status.rollout
    if new not in (Phase.RUNNING, Phase.RESTARTING) or draft.status.ready_epoch is None:
        draft.condition(cond.ROLLOUT_DEGRADED, "False", new.value)
    elif rollout.ready < rollout.desired:
        message = f"{rollout.ready} of {rollout.desired} rollout replicas serve"
        draft.condition(cond.ROLLOUT_DEGRADED, "True", "ReplicasUnavailable", message)
    else:
        draft.condition(cond.ROLLOUT_DEGRADED, "False", "AllReplicasServe")


def _phase_conditions(draft: Draft, *, old: Phase, new: Phase) -> None:
    draft.condition(cond.READY, "True" if new is Phase.RUNNING else "False", new.value)
    draft.condition(cond.SUSPENDED, "True" if new is Phase.SUSPENDED else "False", new.value)
    if new is not Phase.RESTARTING:
        draft.condition(cond.RESTARTING, "False", new.value)
    if new is Phase.SUCCEEDED:
        draft.condition(cond.COMPLETE, "True", "RefitsDone")
    if new is not Phase.FAILED and cond.get_condition(draft.status.conditions, cond.FAILED):
        draft.condition(cond.FAILED, "False", new.value)
