"""The peers one rank is connected to, following the membership: the pure decisions first,
then the thin shell that acts on them (:class:`Peers`).

The rendezvous hands every rank the membership of the epoch as one listing, policy ranks
then rollout ranks, ``None`` for a rank that is absent now.  From it, pure:

* :func:`plan_peer_update`: the peers a rank must forget and load (only those that changed:
  new, gone, or another agent / other buffers under the same rank);
* :func:`targets_for_policy`: the members a policy rank sends a refit to, recomputed per
  refit from ``(T, R)`` and the members.  Rank indices stay stable, so a member's sources
  never depend on which other members are present;
* :func:`expected_sources` and :func:`disagreement`: on a rollout rank, the policy ranks
  whose manifests it must have for a refit, and whether they planned it from the same
  membership (else the refit is declined).

:class:`Peers` holds the connections: a policy rank connects to every rollout member, a
rollout rank to every policy rank present; :meth:`Peers.update` loads and forgets only the
peers that changed (:func:`plan_peer_update`) and tells the engine which agents it forgot,
so that their prepared WRITEs and landing sets are released.  It also holds the world sizes
and membership version the next refits are mapped and stamped with, and builds a refit's
:class:`Target` list from them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..messages.wire import BufferDesc, Manifest, MetadataLike, NixlAgentMetadata, parse_metadata
from ..planning.layout import TargetWeightLayout
from ..planning.mapping import check_world_sizes, source_ranks_for_rollout
from .agent import NixlAgent, PeerError

log = logging.getLogger(__name__)

Role = Literal["policy", "rollout"]
#: A peer by role and rank (not by listing index: ``T`` changes when the policy restarts).
PeerKey = tuple[str, int]


def _identity(meta: NixlAgentMetadata) -> tuple[Any, ...]:
    """What a connection depends on; NIXL's blob may grow with later registrations."""
    return (meta.agent_name, meta.mem_type, meta.buffers, repr(meta.layout))


@dataclass
class Target:
    """A rollout rank this policy rank writes to."""

    rank: int
    agent: str
    buffers: tuple[BufferDesc, ...]
    sources: tuple[int, ...]
    layout: TargetWeightLayout | None
    dev_id: int = 0
    #: Its agent's metadata, to load it again when its remote memory must be forgotten.
    metadata: NixlAgentMetadata | None = None


@dataclass(frozen=True)
class PeerUpdate:
    """What :func:`plan_peer_update` decided: forget ``remove`` first, then load ``add``."""

    remove: tuple[PeerKey, ...]
    add: tuple[tuple[PeerKey, NixlAgentMetadata], ...]


def plan_peer_update(
    current: Mapping[PeerKey, NixlAgentMetadata],
    listing: Sequence[NixlAgentMetadata | None],
    *,
    role: Role,
    train_world_size: int,
    rollout_world_size: int,
) -> PeerUpdate:
    """The peers of the other role to forget and to load so that ``current`` becomes the
    present ranks of ``listing`` (policy ranks, then rollout ranks)."""
    check_world_sizes(train_world_size, rollout_world_size)
    if len(listing) != train_world_size + rollout_world_size:
        raise ValueError(
            f"the listing has {len(listing)} entries for {train_world_size} policy and "
            f"{rollout_world_size} rollout ranks"
        )
    other = "rollout" if role == "policy" else "policy"
    want: dict[PeerKey, NixlAgentMetadata] = {}
    for index, meta in enumerate(listing):
        key: PeerKey = (
            ("policy", index) if index < train_world_size else ("rollout", index - train_world_size)
        )
        if key[0] == other and meta is not None:
            want[key] = meta
    remove = sorted(
        key
        for key, meta in current.items()
        if key not in want or _identity(want[key]) != _identity(meta)
    )
    add = sorted(
        ((key, meta) for key, meta in want.items() if key not in current or key in remove),
        key=lambda item: item[0],
    )
    return PeerUpdate(tuple(remove), tuple(add))


def targets_for_policy(
    worker_rank: int,
    *,
    train_world_size: int,
    rollout_world_size: int,
    members: Collection[int],
    stripe: bool = True,
    sharded: bool = False,
) -> tuple[int, ...]:
    """The members ``worker_rank`` sends this refit to: a sharded refit goes to every
    member (each holds blocks of this rank's shards), else those whose sources include it."""
    check_world_sizes(train_world_size, rollout_world_size)
    present = sorted(r for r in set(members) if 0 <= r < rollout_world_size)
    if sharded:
        return tuple(present)
    return tuple(
        r
        for r in present
        if worker_rank
        in source_ranks_for_rollout(
            r,
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            stripe=stripe,
        )
    )


def expected_sources(
    rollout_rank: int,
    *,
    train_world_size: int,
    rollout_world_size: int,
    stripe: bool = True,
    sharded_senders: Collection[int] | None = None,
) -> tuple[int, ...]:
    """The policy ranks that send ``rollout_rank`` a manifest for one refit, in turn order.

    Unsharded: its sources by :func:`source_ranks_for_rollout`.  Sharded: the first of
    those (it always sends the manifest) and every rank the plan takes buckets from."""
    first = source_ranks_for_rollout(
        rollout_rank,
        train_world_size=train_world_size,
        rollout_world_size=rollout_world_size,
        stripe=stripe,
    )
    if sharded_senders is None:
        return first
    return (first[0], *sorted(set(sharded_senders) - {first[0]}))


def disagreement(manifests: Mapping[int, Manifest | None]) -> str | None:
    """Why the manifests of one refit (by policy rank) cannot be taken together, or None.

    Missing ones, or ones planned from another membership (version, rollout world size) or
    from other weights (plan digest), make the receiver decline the refit."""
    missing = sorted(rank for rank, manifest in manifests.items() if manifest is None)
    if missing:
        return f"no manifest from policy rank(s) {missing}"
    present = {rank: m for rank, m in manifests.items() if m is not None}
    views = {rank: (m.version, m.rollout_world_size) for rank, m in present.items()}
    if len(set(views.values())) > 1:
        shown = ", ".join(
            f"policy rank {rank}: version {v}, R={r}" for rank, (v, r) in sorted(views.items())
        )
        return f"the sources planned from different memberships ({shown})"
    digests = {rank: m.digest for rank, m in present.items()}
    if len(set(digests.values())) > 1:
        return f"the sources disagree on the weights (plan digests {digests})"
    return None


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


__all__ = [
    "PeerKey",
    "PeerUpdate",
    "Peers",
    "Target",
    "disagreement",
    "expected_sources",
    "plan_peer_update",
    "targets_for_policy",
]
