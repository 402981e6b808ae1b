"""``NIXLCheckpointEngine``: bucketed weight streaming from policy to rollout ranks over NIXL.

Same names and signatures as upstream ``nemo_rl.utils.checkpoint_engines.nixl``, plus:
fan-out and striping (:mod:`.mapping`), push by WRITE of only the used bytes straight from
the source tensors, typed JSON control messages with refit ids (:mod:`.messages`),
timeouts on every wait, manifest completeness checks, integrity hashes computed beside the
transfer (``checksum=True``; :mod:`.integrity`), and :meth:`NIXLCheckpointEngine.receive_into`,
which lands a refit straight in the caller's final tensors (no receive buffer, no copy).

Registrations of source and landing memory, the bucket plan and the prepared WRITE handles
are made once and reused while the topology, the tensors' storage and the layout stay the
same (:mod:`.registry`, :class:`~.routes.Routes`).  ``send_weights`` and ``receive_into``
return what the refit cost (a :class:`~.base.RefitTiming`, control work included);
``receive_weight_batches`` hands it to its ``on_complete`` callback.

Flow on every rank::

    meta = engine.prepare()                     # NixlAgentMetadata, JSON-serialisable
    # publish meta.model_dump_json(); gather all ranks' metadata, ORDERED as
    # [policy rank 0 .. T-1, rollout rank 0 .. R-1]
    engine.init_policy_process_group(worker_rank=p, train_world_size=T,
                                     rollout_world_size=R, metadata=all_meta)
    # the membership changed (a rollout rank lost, added; None for an absent rank):
    engine.update_peers(all_meta, train_world_size=T, rollout_world_size=R, version=v)
    timing = await engine.send_weights(model.named_parameters())  # policy
    timing.delivered, timing.dropped            # who confirmed; who was dropped, and why
    async for batch in engine.receive_weight_batches(): ...       # rollout (copy the views)
    got = await engine.receive_into(dict(model.named_parameters()), min_refit=k)
    got.tensors, got.timing
    engine.finalize()

Refit identity: :attr:`NIXLCheckpointEngine.refit_id` is the id of the next refit; each
``send_weights`` / ``receive_weight_batches`` uses it and then increments it, so both sides
stay in step when they run the same refits.  Pass ``refit_id=`` to either call to set it
explicitly (e.g. from the rendezvous store's counter after a restart).  Control messages of
other refits are never taken for the current one; those of earlier refits are dropped.

With ``release_after_refit=True`` the receive buffers are deregistered and freed after each
refit and the peers disconnected; call ``prepare()`` again, re-exchange the metadata and
call ``init_*`` again before the next refit.

A policy rank may pass DTensor weights (FSDP2, tensor parallel, both): it then sends only its
own local shards, and the rollout ranks receive whole tensors (:mod:`.shards`,
:mod:`.shard_plan`); each policy rank connects to every rollout rank it holds blocks for.

Must not import: torch.distributed's collectives (only DTensor types, through
:mod:`.shards`), the operator.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .admission import Decliner, RefitDeclinedError
from .agent import (
    NIXL_DEFAULT_BACKEND_NAME,
    NIXL_TRANSFER_BUFFER_COUNT,
    NixlAgent,
    take_preinit_agent,
)
from .base import CheckpointEngine, RefitTiming
from .integrity import Hasher, algorithm_for
from .layout import TargetWeightLayout
from .mapping import check_world_sizes, source_ranks_for_rollout
from .messages import BufferDesc, MetadataLike, NixlAgentMetadata, parse_metadata
from .peers import Peers, PeerUpdate
from .planning import TensorSpec, check_bucket_size
from .receiver import RefitReceiver, Shared, TargetResolver
from .registry import MemoryRegistry
from .routes import Routes, Target
from .sender import RefitSender, TargetStream
from .shards import is_sharded, local_sources
from .sources import prepare_sources, sources_ready
from .staging import Staging


@dataclass(frozen=True)
class ReceivedRefit:
    """What :meth:`NIXLCheckpointEngine.receive_into` landed, and what that cost."""

    #: The filled targets, by name (the caller's own tensors, or what its resolver gave).
    tensors: Mapping[str, torch.Tensor]
    timing: RefitTiming


def _sync_device(device: torch.device) -> None:
    """Finish queued work on the current stream before memory is exposed to NIXL or a peer."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class NIXLCheckpointEngine(CheckpointEngine):
    """Transfer checkpoint weight buckets through a NIXL backend (see the module docstring)."""

    def __init__(  # noqa: PLR0917 - upstream's positional signature
        self,
        bucket_size: int,
        device: str | torch.device = "cuda",
        backend_name: str = NIXL_DEFAULT_BACKEND_NAME,
        backend_init_params: dict[str, Any] | None = None,
        shard_expert_weights: bool = False,
        release_after_refit: bool = False,
        *,
        timeout_s: float = 120.0,
        checksum: bool = False,
        stripe: bool = True,
        target_layout: TargetWeightLayout | None = None,
        buffer_count: int = NIXL_TRANSFER_BUFFER_COUNT,
        hash_threads: int | None = None,
    ) -> None:
        self.bucket_size = check_bucket_size(bucket_size)
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if (
            isinstance(buffer_count, bool)
            or not isinstance(buffer_count, int)
            or (buffer_count < 2)
        ):
            raise ValueError(f"buffer_count must be an int >= 2, got {buffer_count!r}")
        self.backend_name = backend_name
        self.backend_init_params = backend_init_params
        self.shard_expert_weights = shard_expert_weights
        self.release_after_refit = release_after_refit
        self.timeout_s, self.checksum, self.stripe = float(timeout_s), checksum, stripe
        self.buffer_count = buffer_count
        self.refit_id = 0
        self._layout = target_layout
        self._agent: NixlAgent | None = None
        self._buffers: list[torch.Tensor] = []
        self._staging: Staging | None = None  # reassembly memory kept across refits
        self._registry: MemoryRegistry | None = None
        self._registration: Any = None
        self._role: str | None = None
        self._rank = -1
        self._peers = Peers()  # of the other role, following the membership (update_peers)
        self._sending: RefitSender | None = None
        self._declined: set[tuple[str, int]] = set()  # (source agent, refit) declined
        self._routes: dict[str, Routes] = {}  # per target agent, this connection
        self._sent: dict[str, set[str]] = {}  # landing sets sent per source agent
        self._connections: dict[str, str] = {}  # the connection each source last named
        self._hash_threads = hash_threads
        self._routes_built = 0
        self._hasher: Hasher | None = None
        #: Whether the last :meth:`receive_into` let senders write into its targets (after
        #: a failure: whether they may hold a mix of old and new bytes).
        self.targets_exposed = False

    # -- set-up -------------------------------------------------------------------------
    @property
    def mem_type(self) -> str:
        return "VRAM" if self.device.type == "cuda" else "DRAM"

    @property
    def agent(self) -> NixlAgent:
        if self._agent is None:
            raise RuntimeError("call prepare() first: the engine has no NIXL agent yet")
        return self._agent

    def _allocate_transfer_buffer(self) -> torch.Tensor:
        pin = self.device.type == "cpu" and torch.cuda.is_available()
        return torch.empty(self.bucket_size, dtype=torch.uint8, device=self.device, pin_memory=pin)

    def set_target_weight_layout(self, layout: TargetWeightLayout | None) -> None:
        """Declare the experts / tensor-parallel slice this rollout rank holds."""
        self._layout = layout

    def get_target_weight_layout(self) -> dict[str, Any] | None:
        if not self.shard_expert_weights or self._layout is None:
            return None
        return self._layout.as_dict()

    def prepare(self) -> NixlAgentMetadata:
        """Create the agent (once) and register fresh receive buffers; return the metadata."""
        if self._agent is None:
            self._agent = take_preinit_agent(self.backend_name, self.backend_init_params) or (
                NixlAgent(self.backend_name, self.backend_init_params)
            )
        if self._registry is None:
            self._registry = MemoryRegistry(self.agent, self.mem_type)
        if not self._buffers:
            self._buffers = [self._allocate_transfer_buffer() for _ in range(self.buffer_count)]
            _sync_device(self.device)
            self._registration = self.agent.register(self._regions(), self.mem_type)
        return self.agent.get_agent_metadata().model_copy(
            update={
                "mem_type": self.mem_type,
                "buffers": tuple(
                    BufferDesc(addr=a, length=n, dev_id=d) for a, n, d in self._regions()
                ),
                "layout": self.get_target_weight_layout(),
            }
        )

    def _regions(self) -> list[tuple[int, int, int]]:
        return [(b.data_ptr(), b.numel(), b.device.index or 0) for b in self._buffers]

    def init_policy_process_group(
        self,
        *,
        worker_rank: int,
        train_world_size: int,
        rollout_world_size: int,
        metadata: Sequence[MetadataLike | None],
    ) -> None:
        check_world_sizes(train_world_size, rollout_world_size)
        parse_metadata(metadata, train_world_size + rollout_world_size)
        if isinstance(worker_rank, bool) or not isinstance(worker_rank, int):
            raise ValueError(f"worker_rank must be an int, got {worker_rank!r}")
        if not 0 <= worker_rank < train_world_size:
            raise ValueError(f"worker_rank must be in [0, {train_world_size}), got {worker_rank}")
        self._disconnect_peers()
        # A policy rank only sends from its own tensors; its receive buffers are not needed.
        self._release_transfer_buffers()
        self._role, self._rank = "policy", worker_rank
        self.update_peers(
            metadata, train_world_size=train_world_size, rollout_world_size=rollout_world_size
        )

    def init_rollout_process_group(
        self,
        *,
        rollout_rank: int,
        train_world_size: int,
        rollout_world_size: int,
        metadata: Sequence[MetadataLike | None],
    ) -> None:
        check_world_sizes(train_world_size, rollout_world_size)
        parse_metadata(metadata, train_world_size + rollout_world_size)
        source_ranks_for_rollout(
            rollout_rank, train_world_size=train_world_size, rollout_world_size=rollout_world_size
        )  # names a bad rank
        if not self._buffers:
            raise RuntimeError("call prepare() before init_rollout_process_group()")
        self._disconnect_peers()
        self._role, self._rank = "rollout", rollout_rank
        self.update_peers(
            metadata, train_world_size=train_world_size, rollout_world_size=rollout_world_size
        )

    def update_peers(
        self,
        metadata: Sequence[MetadataLike | None],
        *,
        train_world_size: int,
        rollout_world_size: int,
        version: int = 0,
    ) -> PeerUpdate:
        """Follow a new membership without touching the peers that stayed.

        ``metadata`` lists policy ranks then rollout ranks, ``None`` for a rank absent now.
        Peers of the other role that are new, gone, or changed (another agent, other
        buffers) are loaded / forgotten with ``add_remote_agent`` / ``remove_remote_agent``;
        a forgotten peer's prepared WRITEs and landing sets are released.  Later refits map
        ranks from ``(train_world_size, rollout_world_size)`` and the members present, and
        carry ``version`` in their manifests.  Bad input raises before anything changes.
        Returns what changed.
        """
        if self._role is None:
            raise RuntimeError("call init_policy_process_group() or init_rollout_process_group()")
        return self._peers.update(
            self.agent,
            metadata,
            role="policy" if self._role == "policy" else "rollout",
            rank=self._rank,
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            version=version,
            check=self._check_buffers,
            forgotten=self._forget_routes,
        )

    def _forget_routes(self, agent_name: str) -> None:
        routes = self._routes.pop(agent_name, None)
        if routes is not None:
            routes.clear()  # prepared handles name the peer: release them first
        self._sent.pop(agent_name, None)
        self._connections.pop(agent_name, None)

    @property
    def members(self) -> tuple[int, ...]:
        """The rollout ranks connected now (a policy rank's possible targets)."""
        return self._peers.members

    def _target(self, rollout_rank: int) -> Target:
        """Rollout member ``rollout_rank`` as a target of the next refit."""
        return self._peers.target(rollout_rank, stripe=self.stripe)

    def _check_buffers(self, peer: NixlAgentMetadata, rollout_rank: int) -> None:
        if (
            len(peer.buffers) < 2
            or peer.mem_type != self.mem_type
            or any(b.length < self.bucket_size for b in peer.buffers)
        ):
            raise ValueError(
                f"rollout rank {rollout_rank} offers buffers {list(peer.buffers)} in "
                f"{peer.mem_type}; need >= 2 of >= {self.bucket_size} bytes in {self.mem_type}"
                " (same bucket_size and device on both sides?)"
            )

    # -- refits ---------------------------------------------------------------------------
    def _next_refit(self, refit_id: int | None) -> int:
        if refit_id is not None:
            if isinstance(refit_id, bool) or not isinstance(refit_id, int) or refit_id < 0:
                raise ValueError(f"refit_id must be an int >= 0, got {refit_id!r}")
            self.refit_id = refit_id
        current = self.refit_id
        self.refit_id += 1
        return current

    def _require(self, role: str) -> None:
        if self._role != role:
            raise RuntimeError(
                f"this engine is set up as {self._role or 'nothing'}; call "
                f"init_{role}_process_group() first"
            )

    @property
    def registry(self) -> MemoryRegistry:
        if self._registry is None:
            raise RuntimeError("call prepare() first: the engine has no NIXL agent yet")
        return self._registry

    def _hash_pool(self) -> Hasher:
        if self._hasher is None:
            self._hasher = Hasher(self._hash_threads)
        return self._hasher

    async def send_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, refit_id: int | None = None
    ) -> RefitTiming:
        """Send all of ``weights`` to this refit's targets; return once each confirmed or
        was dropped.

        The targets are the members (see :meth:`update_peers`) this rank sends to.  A target
        that fails, declines or is dropped with :meth:`drop_target` does not fail the send:
        the returned timing lists ``delivered`` and ``dropped`` (rank -> reason); ``bytes``
        are those written to the delivered targets.  Raises only for this rank's own
        failures (bad weights, a local NIXL error).
        """
        self._require("policy")
        given = list(weights)
        sharded = is_sharded(given)
        # The weights are checked before the refit id moves on: bad input changes nothing.
        if sharded:
            local = local_sources(
                given, rank=self._rank, world_size=self._peers.train_world_size, device=self.device
            )
        else:
            items = prepare_sources(given, self.device)
        refit = self._next_refit(refit_id)
        registered = self.registry.registered
        sender = self._sender(refit)
        targets = self._peers.targets(self._rank, stripe=self.stripe, sharded=sharded)
        if sharded:
            streams = sender.plan_sharded(
                [s.held for s in local], {s.held.name: s.local for s in local}, targets
            )
        else:
            streams = sender.plan(items, targets)
        # After the per-target slices: the NIC must not read a copy still in flight.
        ready = sources_ready(self.device)
        self._sending = sender
        try:
            await sender.run(streams, ready)
        finally:
            self._sending = None
        timing = self._timing(sender, streams, registered)
        if self.release_after_refit:
            self._disconnect_peers()
            self.registry.clear()
        return timing

    def _sender(self, refit: int) -> RefitSender:
        """The sender of refit ``refit``, by this engine's settings and membership."""
        return RefitSender(
            self.agent,
            rank=self._rank,
            refit=refit,
            bucket_size=self.bucket_size,
            mem_type=self.mem_type,
            timeout_s=self.timeout_s,
            registry=self.registry,
            routes=self._routes,
            hasher=self._hash_pool() if self.checksum else None,
            integrity=algorithm_for(self.device) if self.checksum else None,
            version=self._peers.version,
            rollout_world_size=self._peers.rollout_world_size,
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
            registrations=self.registry.registered - registered,
            routes_built=built - self._routes_built,
            delivered=delivered,
            dropped=dict(sender.delivery.dropped),
        )
        self._routes_built = built
        return timing

    def drop_target(self, rank: int, reason: str) -> bool:
        """Stop waiting for rollout rank ``rank`` in the send in progress (call it from the
        same event loop, e.g. a task watching the membership); it ends up in ``dropped``.
        Returns whether a send was in progress."""
        if self._sending is None:
            return False
        self._sending.drop(rank, reason)
        return True

    def _receiver(self, refit: int, exact: bool) -> RefitReceiver:
        if self._staging is None:
            self._staging = Staging(self.registry)
        return RefitReceiver(
            self.agent,
            rank=self._rank,
            refit=refit,
            exact=exact,
            buffers=self._buffers,
            peers=self._peers.sources,
            world=(self._peers.train_world_size, self._peers.rollout_world_size, self.stripe),
            timeout_s=self.timeout_s,
            device=self.device,
            shared=Shared(
                self.registry, self._hash_pool, self._sent, self._staging, self._connections
            ),
            decline=Decliner(self.agent, self._rank, self._declined),
        )

    async def _admitted(self, refit_id: int | None, min_refit: int | None) -> RefitReceiver:
        """A receiver whose refit was admitted: exactly ``refit_id`` (default: the next), or
        the first of id >= ``min_refit`` that its sources agree on (declined ones skipped)."""
        self._require("rollout")
        if min_refit is not None and refit_id is not None:
            raise ValueError("pass refit_id= or min_refit=, not both")
        if min_refit is None:
            receiver = self._receiver(self._next_refit(refit_id), exact=True)
            await self._admit(receiver)
            return receiver
        self._next_refit(min_refit)  # validates it
        while True:
            receiver = self._receiver(min_refit, exact=False)
            try:
                await self._admit(receiver)
            except RefitDeclinedError as exc:
                min_refit = exc.refit + 1
                continue
            self.refit_id = receiver.refit + 1
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
            registrations=self.registry.registered - registered,
        )
        if self.release_after_refit:
            self.agent.flush()
            self._disconnect_peers()
            self._release_transfer_buffers()
        return timing

    async def receive_weight_batches(
        self,
        *,
        refit_id: int | None = None,
        min_refit: int | None = None,
        on_complete: Callable[[RefitTiming], None] | None = None,
    ) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        """Yield lists of ``(name, tensor)``; tensors are views valid until the next batch.

        ``on_complete`` gets what the refit cost once the last batch was taken (a
        generator cannot return it); its ``refit_id`` says which refit landed.
        ``min_refit`` as in :meth:`receive_into`.

        Tensors larger than a bucket are views of reassembly memory, valid until the next
        refit starts.  Upstream's API: copy what you keep.  :meth:`receive_into` lands the
        refit in your own tensors instead, with no copy.
        """
        receiver = await self._admitted(refit_id, min_refit)
        registered, nbytes = self.registry.registered, 0
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
    ) -> ReceivedRefit:
        """Receive a refit straight into ``targets``: contiguous tensors by name.

        ``targets`` must hold exactly the sent names with the sent dtypes and shapes
        (otherwise :class:`~.receiver.LayoutMismatchError`, before any byte lands), or be a
        function of the sent :class:`~.planning.TensorSpec` list returning such a mapping.
        Their memory is registered with NIXL once and stays registered while later refits
        land in it.  Returns the targets and what the refit cost once every byte arrived and
        (with ``checksum``) passed its integrity check.  If it raises instead, the targets
        may hold a mix of old and new bytes.

        ``min_refit=k``: take the first refit with id >= k that this rank's sources agree
        on; older refits (and refits whose sources disagree on the membership) are declined
        before anything lands.  ``timing.refit_id`` says which refit landed.
        """
        resolve: TargetResolver
        if callable(targets):
            resolve = targets
        else:
            fixed = targets

            def resolve(specs: Sequence[TensorSpec]) -> Mapping[str, torch.Tensor]:
                return fixed

        receiver = await self._admitted(refit_id, min_refit)
        registered = self.registry.registered
        try:
            resolved = await receiver.into(resolve)
        finally:
            self.targets_exposed = receiver.exposed
        nbytes = sum(t.numel() * t.element_size() for t in resolved.values())
        return ReceivedRefit(resolved, self._received(receiver, nbytes, registered))

    # -- teardown -------------------------------------------------------------------------
    def _disconnect_peers(self) -> None:
        for routes in self._routes.values():
            routes.clear()  # prepared handles name the peer: release them first
        self._routes, self._sent, self._routes_built = {}, {}, 0
        self._connections = {}
        self._peers.clear(self._agent)
        self._role = None

    def _release_transfer_buffers(self) -> None:
        if self._registration is not None and self._agent is not None:
            self._agent.deregister(self._registration)
        self._registration, self._buffers = None, []
        if self._staging is not None:
            self._staging.clear()
        self._staging = None
        if self._registry is not None:
            self._registry.clear()

    def finalize(self) -> None:
        """Disconnect from all peers and free the transfer buffers (``prepare()`` redoes it)."""
        if self._agent is not None:
            self._agent.flush()  # last control messages (e.g. "done") must leave first
        self._disconnect_peers()
        self._release_transfer_buffers()
        if self._hasher is not None:
            self._hasher.close()
            self._hasher = None
