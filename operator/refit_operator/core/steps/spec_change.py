"""Pods rendered from another spec (world size, image, ...) need a new gang: neither a
failure nor a preemption.  Read from the pods' spec-hash annotation, so a lost status
write cannot hide it.
"""

from __future__ import annotations

from refit_operator.core.draft import Draft
from refit_operator.core.phases import Outcome
from refit_operator.core.round_input import RoundInput
from refit_operator.core.steps.restart import restart_gang
from refit_operator.render import pods


def restart_on_spec_change(inp: RoundInput, draft: Draft) -> Outcome | None:
    want = pods.spec_hash(inp.spec)
    if any(p.spec_hash != want for p in inp.current):
        return restart_gang(inp, draft)
    return None
