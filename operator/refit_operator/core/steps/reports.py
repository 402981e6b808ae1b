"""What the ranks of the epoch reported (refits, verification, the rendezvous' health and
whether every rank connected) becomes the status, and what every rollout pod reported
receiving its bytes; never exit codes.

Must not import: kopf, kubernetes, aiohttp.
"""

from __future__ import annotations

from refit_operator.core import progress
from refit_operator.core.draft import Draft
from refit_operator.core.phases import Finding
from refit_operator.core.round_input import RoundInput


def count_bytes(inp: RoundInput, draft: Draft) -> Finding | None:
    """Every round, whatever the steps after it decide (a finished job's last reports
    too): the bytes each rollout pod reported, of any epoch, counted once per pod."""
    status = draft.status
    counted = progress.count_bytes(inp.observed.entries.progress(), status.bytes_counted)
    if counted != status.bytes_counted:
        # Never below the figure already shown: a job an older operator counted (no
        # bytesCounted yet) keeps its figure until its pods' own counts pass it.
        total = max(status.bytes_transferred, progress.bytes_received(counted))
        draft.update(bytes_counted=counted, bytes_transferred=total)
    return None


def record_progress(inp: RoundInput, draft: Draft) -> Finding | None:
    if inp.coordination is not None:
        total = inp.spec.policy.replicas + inp.spec.rollout.replicas
        draft.status = progress.record(
            draft.status, inp.coordination, total, now=inp.now, generation=inp.job.generation
        )
    return None
