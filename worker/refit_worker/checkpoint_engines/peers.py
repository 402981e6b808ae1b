"""The peers one rank is connected to, following the membership (:class:`Peers`).

A policy rank connects to every rollout member, a rollout rank to every policy rank
present; :meth:`Peers.update` loads and forgets only the peers that changed
(:func:`~.membership.plan_peer_update`) and tells the engine which agents it forgot, so that
their prepared WRITEs and landing sets are released.  It also holds the world sizes and
membership version the next refits are mapped and stamped with, and builds a refit's
:class:`~.sender.Target` list from them.

Must not import: torch.distributed, the engine module (``nixl.py``), the operator.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from .agent import NixlAgent, PeerError
from .layout import TargetWeightLayout
from .mapping import check_world_sizes, source_ranks_for_rollout
from .membership import PeerKey, PeerUpdate, Role, plan_peer_update, targets_for_policy
from .messages import MetadataLike, NixlAgentMetadata, parse_metadata
from .routes import Target

log = logging.getLogger(__name__)


class Peers:
    """Connected peers of the other role by (role, rank), and the membership's shape."""

    def __init__(self) -> None:
        self.connected: dict[PeerKey, NixlAgentMetadata] = {}
        self.train_world_size = self.rollout_world_size = 0
        self.version = 0

    def update(
        self,
        agent: NixlAgent,
        metadata: Sequence[MetadataLike | None],
        *,
        role: Role,
        rank: int,
        train_world_size: int,
        rollout_world_size: int,
        version: int,
        check: Callable[[NixlAgentMetadata, int], None],
        forgotten: Callable[[str], None],
    ) -> PeerUpdate:
        """Follow ``metadata`` (policy ranks, then rollout ranks; ``None``: absent).

        ``check(meta, rollout_rank)`` vets each new rollout peer of a policy rank before
        anything changes; ``forgotten(agent_name)`` runs before a peer is removed."""
        check_world_sizes(train_world_size, rollout_world_size)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        if role == "rollout" and rank >= rollout_world_size:
            raise ValueError(f"rollout rank {rank} is not in a membership of {rollout_world_size}")
        parsed = parse_metadata(metadata, train_world_size + rollout_world_size)
        update = plan_peer_update(
            self.connected,
            parsed,
            role=role,
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
        )
        if role == "policy":
            for (_, peer_rank), peer in update.add:
                check(peer, peer_rank)
        for key in update.remove:
            name = self.connected.pop(key).agent_name
            forgotten(name)
            agent.remove_remote_agent(name)
        for key, peer in update.add:
            try:
                agent.add_remote_agent(peer)
            except PeerError as exc:
                # Still listed, but its process is gone (a policy rank that finished
                # before a late replacement connected, a pod that left): absent, tried
                # again at the next update, instead of failing this rank.
                log.warning("%s %d: %s; left out for now", role, rank, exc)
                continue
            self.connected[key] = peer
        self.train_world_size, self.rollout_world_size = train_world_size, rollout_world_size
        self.version = version
        return update

    def clear(self, agent: NixlAgent | None) -> None:
        """Forget every peer (teardown)."""
        if agent is not None:
            for peer in self.connected.values():
                agent.remove_remote_agent(peer.agent_name)
        self.connected = {}

    @property
    def members(self) -> tuple[int, ...]:
        """The rollout ranks connected now."""
        return tuple(sorted(rank for role, rank in self.connected if role == "rollout"))

    def sources(self) -> dict[int, str]:
        """The policy ranks connected now: their agent names, by rank."""
        found = self.connected.items()
        return {rank: m.agent_name for (role, rank), m in found if role == "policy"}

    def target(self, rollout_rank: int, *, stripe: bool) -> Target:
        """Rollout member ``rollout_rank`` as a target of the next refit."""
        peer = self.connected[("rollout", rollout_rank)]
        return Target(
            rank=rollout_rank,
            agent=peer.agent_name,
            buffers=peer.buffers,
            sources=source_ranks_for_rollout(
                rollout_rank,
                train_world_size=self.train_world_size,
                rollout_world_size=self.rollout_world_size,
                stripe=stripe,
            ),
            layout=TargetWeightLayout.model_validate(peer.layout) if peer.layout else None,
            dev_id=peer.buffers[0].dev_id,
            metadata=peer,
        )

    def targets(self, worker_rank: int, *, stripe: bool, sharded: bool) -> list[Target]:
        """Policy rank ``worker_rank``'s targets of the next refit."""
        return [
            self.target(rank, stripe=stripe)
            for rank in targets_for_policy(
                worker_rank,
                train_world_size=self.train_world_size,
                rollout_world_size=self.rollout_world_size,
                members=self.members,
                stripe=stripe,
                sharded=sharded,
            )
        ]


__all__ = ["Peers"]
