"""What the ranks reported, as the job's status: refits, bytes, verification, whether the
gang's work is over and whether it succeeded (never from exit codes alone).

Bytes are one figure everywhere (status, ``refit run``'s rows, total and live view): what
the rollout ranks reported receiving, counted once per pod over every pod the job ever
had (:func:`count_bytes`).

Pure functions from a status to the next status; the reconcile's steps call them.

Must not import: kopf, kubernetes, aiohttp.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime

from refit_operator.core import conditions as cond
from refit_operator.core.coordinate import Coordination, progress_of
from refit_operator.core.observe import Observed, ObservedPod
from refit_operator.models import PodBytes, RefitJobSpec, RefitJobStatus
from refit_worker.contract.rendezvous import ProgressEntry, ProgressSummary
from refit_worker.contract.roles import Role


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
    bytes need nothing here: :func:`count_bytes` counts every pod's report, any epoch."""
    if status.epoch == 0:
        return status
    world = (spec.policy.replicas, spec.rollout.replicas)
    old = progress_of(observed.entries, epoch=status.epoch - 1, world=world)
    if old is None or old.refits_completed <= status.refits_completed:
        return status
    return status.model_copy(update={"refits_completed": old.refits_completed})


def count_bytes(entries: Iterable[ProgressEntry], counted: Sequence[PodBytes]) -> list[PodBytes]:
    """Each rollout pod's bytes: the most it ever reported, by pod uid, over ``counted``
    (what earlier rounds counted) and ``entries`` (the progress reports seen now).

    A rollout pod's report carries its own running total (across policy epochs, which it
    outlives), so the most it reported is what it received: a report read late, or the
    same pod seen under two keys, counts once; a pod replaced, retired by a scale-down or
    stopped with its gang keeps its count once its report is overwritten or cleared.
    Policy ranks' reports are what they sent, not counted.  Order: first counted first.
    """
    most = {c.uid: c.bytes for c in counted}
    for entry in entries:
        if entry.role == "rollout":
            most[entry.uid] = max(most.get(entry.uid, 0), entry.bytes_total)
    return [PodBytes(uid=uid, bytes=n) for uid, n in most.items()]


def bytes_received(counted: Sequence[PodBytes]) -> int:
    """The job's one byte figure (``status.bytesTransferred``)."""
    return sum(c.bytes for c in counted)
