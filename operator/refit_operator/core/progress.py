"""What the ranks reported, as the job's status: refits, bytes, verification, whether the
gang's work is over and whether it succeeded (never from exit codes alone).

Bytes are one figure everywhere (status, ``refit run``'s rows, total and live view),
counted in ``byte_accounting.py``; :func:`count_bytes` and :func:`bytes_received` are
re-exported here for the callers that know them by this module.

Pure functions from a status to the next status; the reconcile's steps call them.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from refit_operator.api.models import RefitJobSpec, RefitJobStatus
from refit_operator.core import conditions as cond
from refit_operator.core.byte_accounting import bytes_received, count_bytes
from refit_operator.core.coordinate import Coordination, progress_of
from refit_operator.core.observe import Observed, ObservedPod
from refit_worker.contract.rendezvous import ProgressSummary
from refit_worker.contract.roles import Role

__all__ = ["bytes_received", "count_bytes", "finished", "fold_previous_epoch", "record"]


def finished(
    spec: RefitJobSpec,
    pods: Mapping[tuple[Role, int], ObservedPod | None],
    progress: ProgressSummary | None,
) -> tuple[bool, str | None]:
    """Whether the gang's work is over, and why it fell short if it did.

    ``pods``: each rank's pod of the round (the epoch's policy pods, the rollout slots' of
    their generation), None where it does not exist.  Over when every one exited 0, or
    went away after its rank reported done.  The job succeeded only if, on top of that,
    every rollout rank reported every refit committed: exit codes alone say nothing about
    refits (``/bin/true`` exits 0).
    """
    done = progress.done if progress is not None else frozenset()
    for key, pod in pods.items():
        if pod is not None and pod.phase == "Succeeded":
            continue
        if (pod is None or pod.deleting) and key in done:
            continue
        return False, None
    want = spec.transfer.refits
    got = progress.refits_completed if progress is not None else 0
    if progress is not None and progress.rollout_done and got >= want:
        return True, None
    return True, (
        f"every pod exited 0, but the rollout ranks reported {got} of {want} refits "
        "committed (workers report each refit to the rendezvous; RefitSession does)"
    )


def record(
    status: RefitJobStatus, coord: Coordination, total: int, *, now: datetime, generation: int
) -> RefitJobStatus:
    """Conditions and figures from the ranks' own reports (never from exit codes)."""
    ok: cond.Truth = "False" if coord.problem else "True"
    reason = "InvalidEntry" if coord.problem else "Readable"
    conds = cond.set_condition(
        status.conditions,
        cond.RENDEZVOUS,
        ok,
        reason=reason,
        message=coord.problem or "",
        now=now,
        generation=generation,
    )
    connected: cond.Truth = "True" if coord.barrier_open else "False"
    conds = cond.set_condition(
        conds,
        cond.CONNECTED,
        connected,
        reason="BarrierOpen" if coord.barrier_open else "WaitingForRanks",
        message="" if coord.barrier_open else f"{coord.published} of {total} ranks published",
        now=now,
        generation=generation,
    )
    status = status.model_copy(update={"conditions": conds})
    p = coord.progress
    if p is None:
        return status
    return status.model_copy(
        update={
            "refits_completed": max(status.refits_completed, p.refits_completed),
            "verification": p.verification if p.refits_completed else status.verification,
            "last_throughput_bytes_per_second": (
                p.last_refit_gbps * 1e9
                if p.last_refit_gbps > 0
                else status.last_throughput_bytes_per_second
            ),
        }
    )


def fold_previous_epoch(
    status: RefitJobStatus, spec: RefitJobSpec, observed: Observed
) -> RefitJobStatus:
    """Add the refits the stopped gang reported after the restart decision (its last
    refit's report can land after it), until its rendezvous entries are cleared.  Its
    bytes need nothing here: ``byte_accounting.py`` counts every pod's report, any epoch."""
    if status.epoch == 0:
        return status
    world = (spec.policy.replicas, spec.rollout.replicas)
    old = progress_of(observed.entries, epoch=status.epoch - 1, world=world)
    if old is None or old.refits_completed <= status.refits_completed:
        return status
    return status.model_copy(update={"refits_completed": old.refits_completed})
