"""Progress reports as workers write them, for tests whose pods are not real workers.

Tests that play kubelet against the API emulator (no processes) write these into the
rendezvous ConfigMap before marking pods Succeeded: a job succeeds on its ranks' reports,
never on exit codes alone.
"""

from __future__ import annotations

from collections.abc import Mapping

from tests.support.fault_runs import rank_of

from refit_worker.contract.entries import ProgressState, Verification
from refit_worker.contract.progress import ProgressLog
from refit_worker.contract.rendezvous import ProgressEntry, encode_entry, progress_key


def reports(
    pod_uids: Mapping[str, str],
    *,
    refits: int,
    nbytes: int = 1000,
    epoch: int = 0,
    state: ProgressState = "done",
    verification: Verification = "checksums",
) -> dict[str, str]:
    """``progress.<role>.<rank>`` values for pods named ``<job>-<role>-<rank>-e<epoch>``
    (policy) or ``<job>-<role>-<rank>-g<generation>`` (rollout)."""
    out: dict[str, str] = {}
    for name, uid in pod_uids.items():
        slot = rank_of(name)
        if slot is None:
            raise ValueError(f"{name!r} is not named <job>-<role>-<rank>-e<N>|g<N>")
        role, rank = slot
        log = ProgressLog(verification=verification if role == "rollout" else "none")
        for refit in range(refits):
            log.record(refit, nbytes, 0.1)
        key = progress_key(role, rank)
        entry = ProgressEntry(epoch=epoch, uid=uid, role=role, rank=rank, **log.fields(state))
        out[key] = encode_entry(key, entry)
    return out
