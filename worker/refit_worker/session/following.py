"""Following the membership the coordinator publishes (the v3 barrier): what a rank decides
from it, pure, first; then the thin shell that reads it and hands the engine the result
(:class:`PeerSet`).

Pure functions over a :class:`~refit_worker.contract.entries.BarrierEntry` (one epoch's
membership: the policy uids and one slot per rollout rank of the desired count, ``None``
where no pod is a member now), the entries of a snapshot and the ranks' progress reports:

- :func:`standing`: a rollout rank's place in it (a member, waiting, removed by a
  scale-down, or stale because another pod holds its slot);
- :func:`members` and :func:`peer_metadata`: whom a policy rank sends to, and the peer list
  the engine's ``update_peers`` takes (policy ranks then rollout ranks, ``None`` where
  absent);

What a policy rank still owes each member, by the ranks' progress reports, is
:mod:`refit_worker.policy.owed`'s.

:class:`PeerSet` keeps the barrier a rank last acted on and turns a newer one into engine
calls: a policy rank hands the members to ``update_peers`` before each refit and, during
a send, drops the targets a newer barrier no longer lists (``drop_target``); a rollout
rank connects to the policy ranks of the epoch it joined.  Only it does I/O (the store's
reads, the engine's calls); the functions above do none.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Literal, TypeAlias

from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.entries import BarrierEntry, MetadataEntry
from refit_worker.contract.rendezvous import read_snapshot
from refit_worker.contract.roles import Role
from refit_worker.contract.waits import Backoff, CancelFlag, poll_until
from refit_worker.engine import NIXLCheckpointEngine
from refit_worker.rendezvous import Member, RendezvousStore, RendezvousTimeout

log = logging.getLogger(__name__)

#: A rollout rank's place in a barrier: listed with its own (uid, generation); its slot
#: empty (not a member now: the coordinator has not listed it yet); its rank no longer in
#: the desired count (a scale-down); or its slot held by another pod (this pod is stale).
Standing: TypeAlias = Literal["member", "waiting", "removed", "superseded"]


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


#: How a wait for a rollout member re-reads the barrier (a ConfigMap GET each time).
_MEMBER_POLL = Backoff(first=0.05, cap=1.0)


class PeerSet:
    """The membership this rank's engine is connected to."""

    def __init__(
        self, store: RendezvousStore, engine: NIXLCheckpointEngine, config: WorkerConfig
    ) -> None:
        self.store, self.engine, self.config = store, engine, config
        #: The barrier the engine's peers were last set from.
        self.barrier: BarrierEntry | None = None
        #: The rollout members the engine was given: rank -> (uid, generation).
        self.targets: dict[int, tuple[str, int]] = {}
        #: The rollout ranks the last ``connect`` was limited to (None: every member).
        self.only: set[int] | None = None
        self._connected = False

    def connect(self, barrier: BarrierEntry, *, only: set[int] | None = None) -> None:
        """Set the engine's peers from ``barrier`` (with ``only``: just those rollout
        ranks); only peers that changed are touched."""
        cfg = self.config
        # Read with the membership's own sizes: a scale-up past the job's first R counts.
        snap = read_snapshot(
            self.store.read_data(),
            barrier.epoch,
            barrier.policy_world_size,
            barrier.rollout_world_size,
        )
        peers = peer_metadata(barrier, snap.meta, only=only)
        rollout_world = len(barrier.rollout)
        if not self._connected:
            if cfg.role == "policy":
                self.engine.init_policy_process_group(
                    worker_rank=cfg.rank,
                    train_world_size=cfg.policy_world_size,
                    rollout_world_size=rollout_world,
                    metadata=peers,
                )
            else:
                self.engine.init_rollout_process_group(
                    rollout_rank=cfg.rank,
                    train_world_size=cfg.policy_world_size,
                    rollout_world_size=rollout_world,
                    metadata=peers,
                )
            self._connected = True
        # The manifests carry the version, so receivers can tell two policy ranks that
        # read the membership a moment apart.
        self.engine.update_peers(
            peers,
            train_world_size=cfg.policy_world_size,
            rollout_world_size=rollout_world,
            version=barrier.version,
        )
        listed = members(barrier)
        self.targets = {
            rank: who
            for rank, who in listed.items()
            if peers[cfg.policy_world_size + rank] is not None
        }
        self.barrier, self.only = barrier, only

    def confirmed(self, delivered: Iterable[int]) -> set[tuple[int, str]]:
        """The (rank, pod uid) of the targets among ``delivered`` (what confirmed a send)."""
        return {(rank, self.targets[rank][0]) for rank in delivered if rank in self.targets}

    def wait_members(
        self, me: Member, timeout: float, cancel: CancelFlag | None = None
    ) -> BarrierEntry:
        """The latest barrier of policy rank ``me``'s epoch once it lists a rollout
        member; raises RendezvousTimeout after ``timeout`` seconds."""
        epoch = me.epoch

        def listed() -> BarrierEntry | None:
            barrier = self.store.barrier(epoch)
            return barrier if barrier is not None and members(barrier) else None

        return poll_until(
            listed,
            timeout=timeout,
            what=f"at least one rollout member in the barrier of epoch {epoch}",
            backoff=_MEMBER_POLL,
            cancel=cancel,
            error=RendezvousTimeout,
        )

    def drop_gone(self, newer: BarrierEntry) -> list[int]:
        """During a send: stop waiting for the targets ``newer`` no longer lists (gone, or
        their slot now holds another pod); returns their ranks."""
        if self.barrier is not None and newer.version <= self.barrier.version:
            return []
        listed = members(newer)
        gone = [rank for rank, who in self.targets.items() if listed.get(rank) != who]
        for rank in gone:
            reason = f"no longer a member in barrier version {newer.version}"
            log.warning(
                "policy rank %d: dropping rollout rank %d: %s", self.config.rank, rank, reason
            )
            self.engine.drop_target(rank, reason)
            del self.targets[rank]
        return gone


__all__ = [
    "PeerSet",
    "Standing",
    "members",
    "peer_metadata",
    "standing",
]
