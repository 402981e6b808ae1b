"""What the rollout slots' progress reports say, read by both roles: pure functions, no I/O.

- :func:`report_for`: the report of the pod that holds a rollout rank now (a report by
  the rank's earlier pod is not its);
- :func:`all_done`: whether every rollout slot's pod reported ``done`` (a lingering
  policy rank may stop; a rollout rank's job is over).
"""

from __future__ import annotations

from collections.abc import Mapping

from refit_worker.contract.entries import BarrierEntry, ProgressEntry
from refit_worker.contract.roles import Role

Progress = Mapping[tuple[Role, int], ProgressEntry]


def report_for(progress: Progress, rank: int, uid: str) -> ProgressEntry | None:
    """The report of rollout rank ``rank`` by the pod ``uid``, if that pod made it."""
    entry = progress.get(("rollout", rank))
    return entry if entry is not None and entry.uid == uid else None


def all_done(barrier: BarrierEntry, progress: Progress) -> bool:
    """Every rollout slot is done: its member's pod reported ``done``, or (an empty slot)
    the rank's last report, by the pod that held it, says ``done`` (a coordinator may
    drop a pod that finished and exited from the membership), unless the slot is held
    for a later generation than that pod's."""
    for rank, slot in enumerate(barrier.rollout):
        if slot is None:
            report = progress.get(("rollout", rank))
            # A pod of an older generation than the slot is held for was replaced: a
            # replacement is on its way and owed the last refit (a drain during the final
            # commit), whatever the pod it replaces reported.
            if report is not None and report.generation < barrier.generation_of(rank):
                return False
        else:
            report = report_for(progress, rank, slot.uid)
        if report is None or report.state != "done":
            return False
    return True
