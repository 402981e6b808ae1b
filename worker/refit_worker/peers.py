"""The session's reads of the membership, and what it hands the engine from them.

:class:`PeerSet` keeps the barrier a rank last acted on and turns a newer one into engine
calls: a policy rank hands the members to ``update_peers`` before each refit and, during
a send, drops the targets a newer barrier no longer lists (``drop_target``); a rollout
rank connects to the policy ranks of the epoch it joined.  The decisions themselves are
pure, in :mod:`refit_worker.membership`.

Must not import: the operator, kubernetes (the store does that lazily).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from refit_worker.checkpoint_engines import NIXLCheckpointEngine
from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.entries import BarrierEntry
from refit_worker.contract.rendezvous import read_snapshot
from refit_worker.membership import members, peer_metadata
from refit_worker.rendezvous import Member, RendezvousStore, RendezvousTimeout
from refit_worker.waits import Backoff, CancelFlag, poll_until

log = logging.getLogger(__name__)

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


__all__ = ["PeerSet"]
