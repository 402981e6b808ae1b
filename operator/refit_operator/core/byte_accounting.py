"""Byte accounting: the one figure for the bytes a job moved, ``status.bytesTransferred``,
and the per-pod counts it sums (``status.bytesCounted``).

The figure is what the rollout ranks reported receiving, counted once per pod over every
pod the job ever had: each rollout pod's report carries its own running total (across
the policy epochs it outlives), so the most it ever reported is what it received.  The
reconcile accounts every round, before any policy decides (a finished job's last reports
too); a restart, a replacement, a retirement or a failure never touches the figures, so
a stopped pod's bytes stay counted once its report is cleared.  ``refit run``'s ledger
counts with the same functions.

Pure: it reads reports and a status, nothing a round derives.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from refit_operator.api.models import PodBytes, RefitJobStatus
from refit_worker.contract.rendezvous import ProgressEntry


def count_bytes(entries: Iterable[ProgressEntry], counted: Sequence[PodBytes]) -> list[PodBytes]:
    """Each rollout pod's bytes: the most it ever reported, by pod uid, over ``counted``
    (what earlier rounds counted) and ``entries`` (the progress reports seen now).

    A report read late, or the same pod seen under two keys, counts once; a pod replaced,
    retired by a scale-down or stopped with its gang keeps its count once its report is
    overwritten or cleared.  Policy ranks' reports are what they sent, not counted.
    Order: first counted first.
    """
    most = {c.uid: c.bytes for c in counted}
    for entry in entries:
        if entry.role == "rollout":
            most[entry.uid] = max(most.get(entry.uid, 0), entry.bytes_total)
    return [PodBytes(uid=uid, bytes=n) for uid, n in most.items()]


def bytes_received(counted: Sequence[PodBytes]) -> int:
    """The job's one byte figure (``status.bytesTransferred``)."""
    return sum(c.bytes for c in counted)


def account(status: RefitJobStatus, entries: Iterable[ProgressEntry]) -> RefitJobStatus:
    """``status`` with the bytes of ``entries`` counted (the same object when they add
    nothing)."""
    counted = count_bytes(entries, status.bytes_counted)
    if counted == status.bytes_counted:
        return status
    # Never below the figure already shown: a job an older operator counted (no
    # bytesCounted yet) keeps its figure until its pods' own counts pass it.
    total = max(status.bytes_transferred, bytes_received(counted))
    return status.model_copy(update={"bytes_counted": counted, "bytes_transferred": total})
