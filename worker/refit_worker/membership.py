"""What a rank decides from the membership the coordinator publishes (the v3 barrier).

Pure functions over a :class:`~refit_worker.contract.entries.BarrierEntry` (one epoch's
membership: the policy uids and one slot per rollout rank of the desired count, ``None``
where no pod is a member now), the entries of a snapshot and the ranks' progress reports:

- :func:`standing`: a rollout rank's place in it (a member, waiting, removed by a
  scale-down, or stale because another pod holds its slot);
- :func:`members` and :func:`peer_metadata`: whom a policy rank sends to, and the peer list
  the engine's ``update_peers`` takes (policy ranks then rollout ranks, ``None`` where
  absent);
- :func:`lacking` and :func:`all_done`: what a policy rank that lingers after the last
  refit still owes, and when it may stop;
- :func:`all_have`: whether a send's targets already committed the refit.

Must not import: torch, nixl, the operator; nothing that does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, TypeAlias

from refit_worker.contract.entries import BarrierEntry, MetadataEntry, ProgressEntry
from refit_worker.contract.roles import Role
from refit_worker.rendezvous import Member

#: A rollout rank's place in a barrier: listed with its own (uid, generation); its slot
#: empty (not a member now: the coordinator has not listed it yet); its rank no longer in
#: the desired count (a scale-down); or its slot held by another pod (this pod is stale).
Standing: TypeAlias = Literal["member", "waiting", "removed", "superseded"]

Progress = Mapping[tuple[Role, int], ProgressEntry]


def standing(barrier: BarrierEntry, me: Member) -> Standing:
    """Where rollout rank ``me`` stands in ``barrier`` (an epoch's membership)."""
    if me.rank >= len(barrier.rollout):
        return "removed"
    slot = barrier.rollout[me.rank]
    if slot is None:
        return "waiting"
    if (slot.uid, slot.generation) == (me.uid, me.generation):
        return "member"
    return "superseded"


def members(barrier: BarrierEntry) -> dict[int, tuple[str, int]]:
    """The rollout members: rank -> (pod uid, generation)."""
    return {
        rank: (slot.uid, slot.generation)
        for rank, slot in enumerate(barrier.rollout)
        if slot is not None
    }


def peer_metadata(
    barrier: BarrierEntry,
    meta: Mapping[tuple[Role, int], MetadataEntry],
    *,
    only: set[int] | None = None,
) -> list[str | None]:
    """Agent metadata ordered policy ranks then rollout ranks, ``None`` for an absent rank.

    ``meta`` holds the entries of the barrier's epoch.  A policy rank counts when its
    entry is the pod the barrier lists; a rollout rank when it is a member with the same
    (uid, generation), and (with ``only``) its rank is in ``only``.
    """
    peers: list[str | None] = []
    for rank, uid in enumerate(barrier.policy_uids):
        entry = meta.get(("policy", rank))
        peers.append(entry.agent if entry is not None and entry.uid == uid else None)
    listed = members(barrier)
    for rank in range(len(barrier.rollout)):
        entry = meta.get(("rollout", rank))
        ok = (
            entry is not None
            and rank in listed
            and (entry.uid, entry.generation) == listed[rank]
            and (only is None or rank in only)
        )
        peers.append(entry.agent if ok and entry is not None else None)
    return peers


def _report(progress: Progress, rank: int, uid: str) -> ProgressEntry | None:
    entry = progress.get(("rollout", rank))
    return entry if entry is not None and entry.uid == uid else None


def lacking(barrier: BarrierEntry, progress: Progress, refits: int) -> set[int]:
    """Members that have not committed the job's last refit (``refits - 1``) yet, by the
    reports of the pod now in their slot."""
    owed = set()
    for rank, (uid, _generation) in members(barrier).items():
        report = _report(progress, rank, uid)
        if report is None or (report.refits_completed < refits and report.state == "running"):
            owed.add(rank)
    return owed


def all_have(targets: Mapping[int, tuple[str, int]], progress: Progress, refit_id: int) -> bool:
    """Whether the pod now in each target's slot (rank -> (uid, generation)) reported refit
    ``refit_id`` committed; False for no targets."""
    return bool(targets) and all(
        (report := _report(progress, rank, uid)) is not None and report.refits_completed > refit_id
        for rank, (uid, _generation) in targets.items()
    )


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
            report = _report(progress, rank, slot.uid)
        if report is None or report.state != "done":
            return False
    return True


__all__ = [
    "Progress",
    "Standing",
    "all_done",
    "all_have",
    "lacking",
    "members",
    "peer_metadata",
    "standing",
]
