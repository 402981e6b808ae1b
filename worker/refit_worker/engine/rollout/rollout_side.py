"""A rollout rank's part of the engine, per connection: :class:`RolloutSide`, and what it
keeps beyond one connection, :class:`RolloutKept`.

:class:`RolloutSide` lives from ``init_rollout_process_group()`` until the peers are
disconnected: it admits refits (:mod:`.admission`), runs each as a
:class:`~.refit.RefitReceiver`, and holds what belongs to this connection: the landing
sets already sent to each source and the connection each source last named.

:class:`RolloutKept` outlives it, with the engine: the receive buffers that ``prepare()``
registers and offers in the metadata before the role is known (a policy rank frees them
at its ``init``), the reassembly memory kept across refits (:mod:`.staging`), the declines
sent (at most one per source agent and refit), and whether the last ``receive_into`` let
senders write into its targets.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base import RefitTiming
from ..delta.codec import DeltaArena
from ..messages.wire import DeltaHeader
from ..planning.buckets import TensorSpec
from ..transport.common import EngineCommon
from .admission import Decliner, RefitDeclinedError
from .refit_receive import DeltaTarget, RefitReceiver, Shared, TargetResolver
from .staging import Staging


@dataclass(frozen=True)
class ReceivedRefit:
    """What :meth:`NIXLCheckpointEngine.receive_into` landed, and what that cost."""

    #: The filled targets, by name (the caller's own tensors, or what its resolver gave).
    tensors: Mapping[str, torch.Tensor]
    timing: RefitTiming
    #: A delta refit: what it was applied onto (``tensors`` are then the filled spare
    #: copy); None: the refit came whole.
    delta: DeltaHeader | None = None


def _sync_device(device: torch.device) -> None:
    """Finish queued work on the current stream before memory is exposed to NIXL or a peer."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@dataclass
class RolloutKept:
    """What a rollout rank keeps across connections (see the module docstring)."""

    buffers: list[torch.Tensor] = field(default_factory=list)
    registration: Any = None
    staging: Staging | None = None  # reassembly memory kept across refits
    delta_arena: DeltaArena = field(default_factory=DeltaArena)  # where deltas land
    declined: set[tuple[str, int]] = field(default_factory=set)  # (source agent, refit)
    #: Whether the last ``receive_into`` let senders write into its targets (after a
    #: failure: whether they may hold a mix of old and new bytes).
    targets_exposed: bool = False

    def offer(self, common: EngineCommon, count: int) -> None:
        """Allocate and register ``count`` receive buffers of a bucket each, once."""
        if self.buffers:
            return
        device = common.device
        pin = device.type == "cpu" and torch.cuda.is_available()
        self.buffers = [
            torch.empty(common.bucket_size, dtype=torch.uint8, device=device, pin_memory=pin)
            for _ in range(count)
        ]
        _sync_device(device)
        self.registration = common.agent.register(self.regions(), common.mem_type)

    def regions(self) -> list[tuple[int, int, int]]:
        return [(b.data_ptr(), b.numel(), b.device.index or 0) for b in self.buffers]

    def release(self, common: EngineCommon) -> None:
        """Deregister and free the receive buffers and the reassembly memory."""
        if self.registration is not None and common.nixl_agent is not None:
            common.nixl_agent.deregister(self.registration)
        self.registration, self.buffers = None, []
        if self.staging is not None:
            self.staging.clear()
        self.staging = None
        if common.memory is not None:
            common.memory.clear()


class RolloutSide:
    """Receives refits on rollout rank ``rank`` from its sources (see the module)."""

    def __init__(
        self, common: EngineCommon, *, rank: int, kept: RolloutKept, after: Callable[[], None]
    ) -> None:
        self.common, self.rank, self.kept = common, rank, kept
        self._after = after  # the engine's end of a refit (release_after_refit)
        self._sent: dict[str, set[str]] = {}  # landing sets sent per source agent
        self._connections: dict[str, str] = {}  # the connection each source last named

    def forget(self, agent_name: str) -> None:
        """Forget what was sent to the peer ``agent_name`` (it left, or changed)."""
        self._sent.pop(agent_name, None)
        self._connections.pop(agent_name, None)

    def _receiver(self, refit: int, exact: bool, delta: DeltaTarget | None = None) -> RefitReceiver:
        common, kept = self.common, self.kept
        if kept.staging is None:
            kept.staging = Staging(common.registry)
        peers = common.peers
        return RefitReceiver(
            common.agent,
            rank=self.rank,
            refit=refit,
            exact=exact,
            buffers=kept.buffers,
            peers=peers.sources,
            world=(peers.train_world_size, peers.rollout_world_size, common.stripe),
            timeout_s=common.timeout_s,
            device=common.device,
            shared=Shared(
                common.registry,
                common.hash_pool,
                self._sent,
                kept.staging,
                self._connections,
                kept.delta_arena,
                require_integrity=common.checksum,
                verifier=common.verifier,
            ),
            decline=Decliner(common.agent, self.rank, kept.declined),
            delta=delta,
        )

    async def _admitted(
        self, refit_id: int | None, min_refit: int | None, delta: DeltaTarget | None = None
    ) -> RefitReceiver:
        """A receiver whose refit was admitted: exactly ``refit_id`` (default: the next), or
        the first of id >= ``min_refit`` that its sources agree on (declined ones skipped;
        a delta declined for the whole refit is waited for again, whole)."""
        if min_refit is not None and refit_id is not None:
            raise ValueError("pass refit_id= or min_refit=, not both")
        if min_refit is None:
            refit = self.common.next_refit(refit_id)
            while True:
                receiver = self._receiver(refit, exact=True, delta=delta)
                try:
                    await self._admit(receiver)
                except RefitDeclinedError as exc:
                    if not exc.whole:
                        raise
                    continue
                return receiver
        self.common.next_refit(min_refit)  # validates it
        while True:
            receiver = self._receiver(min_refit, exact=False, delta=delta)
            try:
                await self._admit(receiver)
            except RefitDeclinedError as exc:
                min_refit = exc.refit if exc.whole else exc.refit + 1
                continue
            self.common.refit_id = receiver.refit + 1
            return receiver

    @staticmethod
    async def _admit(receiver: RefitReceiver) -> None:
        try:
            await receiver.admit()
        except BaseException as exc:
            receiver.fail(exc)  # tells the sources (a decline told them already)
            raise

    def _received(self, receiver: RefitReceiver, nbytes: int, registered: int) -> RefitTiming:
        timing = RefitTiming(
            refit_id=receiver.refit,
            role="rollout",
            bytes=nbytes,
            seconds=receiver.ended_at - receiver.started_at,
            control_s=receiver.control_s,
            registrations=self.common.registry.registered - registered,
            integrity=receiver.integrity,
            signed_by=receiver.signed_by,
            seals=receiver.seals,
            seal_s=receiver.seal_s,
            known_hashes=receiver.known.by_name,
        )
        self._after()
        return timing

    def decline_pending(self, below: int, reason: str) -> int:
        """Decline every manifest a policy peer sent for a refit < ``below`` (this rank has
        those already: it stays to seed peers, or hands over); also moves NIXL along, so
        peers' READs of this rank's memory progress.  Returns how many were declined."""
        agent, count = self.common.agent, 0
        decline = Decliner(agent, self.rank, self.kept.declined)
        for peer in self.common.peers.sources().values():
            for refit in agent.pending(peer, "manifest"):
                if refit < below:
                    decline(peer, refit, reason)
                    agent.discard(peer, "manifest", refit)
                    count += 1
        return count

    async def receive_weight_batches(
        self,
        *,
        refit_id: int | None = None,
        min_refit: int | None = None,
        on_complete: Callable[[RefitTiming], None] | None = None,
    ) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        """:meth:`NIXLCheckpointEngine.receive_weight_batches`: views, batch by batch."""
        receiver = await self._admitted(refit_id, min_refit)
        registered, nbytes = self.common.registry.registered, 0
        async for batch in receiver.batches():
            nbytes += sum(t.numel() * t.element_size() for _, t in batch)
            yield batch
        timing = self._received(receiver, nbytes, registered)
        if on_complete is not None:
            on_complete(timing)

    async def receive_into(
        self,
        targets: Mapping[str, torch.Tensor] | TargetResolver,
        *,
        refit_id: int | None = None,
        min_refit: int | None = None,
        delta: DeltaTarget | None = None,
    ) -> ReceivedRefit:
        """:meth:`NIXLCheckpointEngine.receive_into`: land a refit in ``targets``."""
        resolve: TargetResolver
        if callable(targets):
            resolve = targets
        else:
            fixed = targets

            def resolve(specs: Sequence[TensorSpec]) -> Mapping[str, torch.Tensor]:
                return fixed

        while True:
            receiver = await self._admitted(refit_id, min_refit, delta)
            registered = self.common.registry.registered
            try:
                resolved = await receiver.into(resolve)
            except RefitDeclinedError as exc:
                if not exc.whole:
                    raise
                # The delta's result was not the trainer's: the senders send it whole.
                refit_id, min_refit = (exc.refit, None) if min_refit is None else (None, exc.refit)
                continue
            finally:
                self.kept.targets_exposed = receiver.exposed
            header = receiver.manifest.delta if receiver.manifest is not None else None
            if header is not None:
                nbytes = header.nbytes
            else:
                nbytes = sum(t.numel() * t.element_size() for t in resolved.values())
            timing = self._received(receiver, nbytes, registered)
            return ReceivedRefit(resolved, timing, header)


__all__ = ["ReceivedRefit", "RolloutKept", "RolloutSide"]
