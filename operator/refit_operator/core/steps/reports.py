"""What the ranks of the epoch reported (refits, verification, the rendezvous' health and
whether every rank connected) becomes the status; never exit codes.  Their bytes are
``byte_accounting.py``'s, counted before any step runs.
"""

from __future__ import annotations

from refit_operator.core import progress
from refit_operator.core.coordinate import decide_barrier
from refit_operator.core.draft import Draft
from refit_operator.core.round_input import RoundInput


def record_progress(inp: RoundInput, draft: Draft) -> None:
    if inp.rendezvous is not None:
        total = inp.spec.policy.replicas + inp.spec.rollout.replicas
        barrier = decide_barrier(inp.rendezvous)
        draft.status = progress.record(
            draft.status, barrier, total, now=inp.now, generation=inp.job.generation
        )
