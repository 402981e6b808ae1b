"""A policy rank's part of the engine, per connection: :class:`PolicySide`.

It lives from ``init_policy_process_group()`` until the peers are disconnected, and holds
what only a sender needs: the :class:`~.routes.Routes` kept per target agent on this
connection (landing sets, prepared WRITEs, the manifest) and the send in progress, which
:meth:`PolicySide.drop_target` reaches.  Each refit is one :class:`~.refit.RefitSender`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from ..base import RefitTiming
from ..delta.codec import DELTA_TENSOR
from ..messages.integrity import algorithm_for
from ..messages.wire import DeltaHeader
from ..planning.boxes import Box
from ..planning.shard_plan import Holding
from ..transport.common import EngineCommon
from .dtensors import ShardedSource, is_sharded, local_sources
from .refit_send import RefitSender, TargetStream
from .routes import Routes
from .sources import prepare_sources, sources_ready


class DeltaNotApplicable(ValueError):
    """A delta cannot go to this refit's targets (one reshapes the weights it receives);
    raised before anything is sent: send the refit whole."""


class PolicySide:
    """Sends refits from policy rank ``rank`` to the rollout members (see the module)."""

    def __init__(self, common: EngineCommon, *, rank: int, after: Callable[[], None]) -> None:
        self.common, self.rank = common, rank
        self._after = after  # the engine's end of a refit (release_after_refit)
        self._routes: dict[str, Routes] = {}  # per target agent, this connection
        self._routes_built = 0  # so far on this connection, for the next timing's count
        self._sending: RefitSender | None = None

    async def send_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        refit_id: int | None = None,
        delta: DeltaHeader | None = None,
        pieces: tuple[tuple[int, Box], ...] | None = None,
    ) -> RefitTiming:
        """:meth:`NIXLCheckpointEngine.send_weights`: send to this refit's targets."""
        common, peers = self.common, self.common.peers
        given = list(weights)
        sharded = is_sharded(given)
        if delta is not None:
            self._check_delta(given, sharded)
        elif pieces is not None:
            raise ValueError("pieces name a sharded delta's parts: pass its header as delta=")
        # The weights are checked before the refit id moves on: bad input changes nothing.
        if delta is not None and pieces is not None:
            local = [_delta_piece(delta, pieces, given[0][1], self.rank, common.device)]
            sharded = True
        elif sharded:
            local = local_sources(
                given, rank=self.rank, world_size=peers.train_world_size, device=common.device
            )
        else:
            items = prepare_sources(given, common.device)
        refit = common.next_refit(refit_id)
        registered = common.registry.registered
        sender = self._sender(refit, delta)
        targets = peers.targets(self.rank, stripe=common.stripe, sharded=sharded)
        if sharded:
            streams = sender.plan_sharded(
                [s.held for s in local], {s.held.name: s.local for s in local}, targets
            )
        else:
            streams = sender.plan(items, targets)
        # After the per-target slices: the NIC must not read a copy still in flight.
        ready = sources_ready(common.device)
        self._sending = sender
        try:
            await sender.run(streams, ready)
        finally:
            self._sending = None
        timing = self._timing(sender, streams, registered)
        self._after()
        return timing

    def _check_delta(self, given: list[tuple[str, torch.Tensor]], sharded: bool) -> None:
        names = [name for name, _ in given]
        if sharded or names != [DELTA_TENSOR]:
            raise ValueError(
                f"a delta refit sends the one tensor {DELTA_TENSOR!r}, got {names[:5]}"
            )
        peers = self.common.peers
        shaped = [
            t.rank
            for t in peers.targets(self.rank, stripe=self.common.stripe, sharded=False)
            if t.layout is not None
        ]
        if shaped:
            raise DeltaNotApplicable(
                f"rollout ranks {shaped} receive the weights in a layout of their own, "
                "which a delta of the sent tensors does not fit"
            )

    def _sender(self, refit: int, delta: DeltaHeader | None) -> RefitSender:
        """The sender of refit ``refit``, by the engine's settings and membership."""
        common = self.common
        return RefitSender(
            common.agent,
            rank=self.rank,
            refit=refit,
            bucket_size=common.bucket_size,
            mem_type=common.mem_type,
            timeout_s=common.timeout_s,
            registry=common.registry,
            routes=self._routes,
            hasher=common.hash_pool() if common.checksum else None,
            integrity=algorithm_for(common.device) if common.checksum else None,
            version=common.peers.version,
            rollout_world_size=common.peers.rollout_world_size,
            delta=delta,
            signer=common.signer,
        )

    def _timing(
        self, sender: RefitSender, streams: Sequence[TargetStream], registered: int
    ) -> RefitTiming:
        """What the send did: bytes count only the targets that confirmed."""
        built = sum(r.built for r in self._routes.values())
        delivered = sender.delivery.delivered(s.target.rank for s in streams)
        timing = RefitTiming(
            refit_id=sender.refit,
            role="policy",
            bytes=sum(s.nbytes for s in streams if s.target.rank in delivered),
            seconds=sender.ended_at - sender.started_at,
            control_s=sender.control_s,
            registrations=self.common.registry.registered - registered,
            routes_built=built - self._routes_built,
            delivered=delivered,
            dropped=dict(sender.delivery.dropped),
            wants_whole=frozenset(sender.delivery.wants_whole),
            seal_s=sender.sign_s,
        )
        self._routes_built = built
        return timing

    def drop_target(self, rank: int, reason: str) -> bool:
        """Stop waiting for rollout rank ``rank`` in the send in progress, if one is."""
        if self._sending is None:
            return False
        self._sending.drop(rank, reason)
        return True

    def forget(self, agent_name: str) -> None:
        """Release what names the peer ``agent_name`` (it left, or changed)."""
        routes = self._routes.pop(agent_name, None)
        if routes is not None:
            routes.clear()  # prepared handles name the peer: release them first

    def disconnect(self) -> None:
        """Release every target's prepared WRITEs (before the peers themselves go)."""
        for routes in self._routes.values():
            routes.clear()  # prepared handles name the peer: release them first
        self._routes = {}


def _delta_piece(
    delta: DeltaHeader,
    pieces: tuple[tuple[int, Box], ...],
    piece: torch.Tensor,
    rank: int,
    device: torch.device,
) -> ShardedSource:
    """This rank's piece of a sharded delta as the block it holds of the delta tensor."""
    mine = [box for r, box in pieces if r == rank]
    if len(mine) != 1 or mine[0].size != (piece.numel(),) or piece.dtype != torch.uint8:
        raise ValueError(
            f"policy rank {rank}: its delta piece is {piece.numel()} x {piece.dtype}, the "
            f"pieces give it {mine}"
        )
    if sum(box.numel for _, box in pieces) != delta.nbytes:
        raise ValueError(
            f"the pieces hold {sum(box.numel for _, box in pieces)} bytes, the delta {delta.nbytes}"
        )
    held = Holding(DELTA_TENSOR, "uint8", (delta.nbytes,), pieces)
    return ShardedSource(held, piece.to(device).contiguous())


__all__ = ["DeltaNotApplicable", "PolicySide"]
