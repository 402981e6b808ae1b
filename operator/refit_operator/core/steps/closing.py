"""The end of every round that got past the spec check: the conditions that follow from
the new phase, the phase itself, the message it shows, the role counts, and an Event for
a phase move.

Must not import: kopf, kubernetes, aiohttp.
"""

from __future__ import annotations

from typing import Literal

from refit_operator.core import conditions as cond
from refit_operator.core import progress
from refit_operator.core.decision import Emit
from refit_operator.core.draft import Draft
from refit_operator.core.round_input import RoundInput
from refit_operator.models import Phase


def close_round(inp: RoundInput, draft: Draft, *, old: Phase, new: Phase) -> None:
    _phase_conditions(draft, old=old, new=new)
    if new in (Phase.RESTARTING, Phase.FAILED):
        message = draft.status.message
    elif new is Phase.PENDING:
        message = draft.waiting
    else:
        message = ""
    epoch = draft.status.epoch
    draft.update(
        phase=new,
        message=message,
        observed_generation=inp.job.generation,
        policy=progress.role_status(inp.spec, inp.observed.pods, epoch, "policy"),
        rollout=progress.role_status(inp.spec, inp.observed.pods, epoch, "rollout"),
    )
    if new is not old:
        kind: Literal["Normal", "Warning"] = "Warning" if new is Phase.FAILED else "Normal"
        text = f"phase {old.value} -> {new.value}" + (f": {message}" if message else "")
        draft.actions.append(Emit(kind, new.value, text))


def _phase_conditions(draft: Draft, *, old: Phase, new: Phase) -> None:
    draft.condition(cond.READY, "True" if new is Phase.RUNNING else "False", new.value)
    draft.condition(cond.SUSPENDED, "True" if new is Phase.SUSPENDED else "False", new.value)
    if new is not Phase.RESTARTING:
        draft.condition(cond.RESTARTING, "False", new.value)
    if new is Phase.SUCCEEDED:
        draft.condition(cond.COMPLETE, "True", "RefitsDone")
    if new is Phase.FAILED and old is not Phase.FAILED:
        draft.condition(cond.FAILED, "True", draft.failed_reason, draft.status.message)
    elif new is not Phase.FAILED and cond.get_condition(draft.status.conditions, cond.FAILED):
        draft.condition(cond.FAILED, "False", new.value)
