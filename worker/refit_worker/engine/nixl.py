"""``NIXLCheckpointEngine``: bucketed weight streaming from policy to rollout ranks over NIXL.

Same names and signatures as upstream ``nemo_rl.utils.checkpoint_engines.nixl``, plus:
fan-out and striping (:mod:`.planning.mapping`), push by WRITE of only the used bytes straight from
the source tensors, typed JSON control messages with refit ids (:mod:`.messages.wire`),
timeouts on every wait, manifest completeness checks, integrity hashes computed beside the
transfer (``checksum=True``; :mod:`.messages.integrity`), and
:meth:`NIXLCheckpointEngine.receive_into`, which lands a refit straight in the caller's final
tensors (no receive buffer, no copy).

Registrations of source and landing memory, the bucket plan and the prepared WRITE handles
are made once and reused while the topology, the tensors' storage and the layout stay the
same (:mod:`.transport.registry`, :class:`~.policy.routes.Routes`).  ``send_weights`` and
``receive_into`` return what the refit cost (a :class:`~.base.RefitTiming`, control work included);
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
own local shards, and the rollout ranks receive whole tensors (:mod:`.policy.dtensors`,
:mod:`.planning.shard_plan`); each policy rank connects to every rollout rank it holds blocks for.

The engine is a front: what both roles use is an :class:`~.transport.common.EngineCommon`;
``init_policy_process_group`` creates a :class:`~.policy.side.PolicySide`,
``init_rollout_process_group`` a :class:`~.rollout.side.RolloutSide`, and the role's
methods delegate to it until the peers are disconnected.  The engine's role is which part
it has.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import torch

from refit_worker.contract.config import TransferConfig

from .base import CheckpointEngine, RefitTiming
from .messages.signing import RefitSigner, RefitVerifier
from .messages.wire import (
    BufferDesc,
    DeltaHeader,
    MetadataLike,
    NixlAgentMetadata,
    parse_metadata,
)
from .planning.boxes import Box
from .planning.buckets import check_bucket_size
from .planning.layout import TargetWeightLayout
from .planning.mapping import check_world_sizes, source_ranks_for_rollout
from .policy.policy_side import PolicySide
from .rollout.refit_receive import DeltaTarget, TargetResolver
from .rollout.rollout_side import ReceivedRefit, RolloutKept, RolloutSide
from .transport.agent import NIXL_DEFAULT_BACKEND_NAME, NIXL_TRANSFER_BUFFER_COUNT
from .transport.common import EngineCommon
from .transport.peers import PeerUpdate, Role, Target


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
        signer: RefitSigner | None = None,
        verifier: RefitVerifier | None = None,
    ) -> None:
        size, where = check_bucket_size(bucket_size), torch.device(device)
        if where.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if where.type == "cuda" and not torch.cuda.is_available():
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
        self.buffer_count = buffer_count
        self._layout = target_layout
        self._common = EngineCommon(
            bucket_size=size,
            device=where,
            timeout_s=float(timeout_s),
            checksum=checksum,
            stripe=stripe,
            hash_threads=hash_threads,
            signer=signer,
            verifier=verifier,
        )
        self._kept = RolloutKept()  # the receive side's memory, from prepare() on
        # The role is which part exists: set by init_*, dropped when the peers go.
        self._policy: PolicySide | None = None
        self._rollout: RolloutSide | None = None

    @classmethod
    def from_config(
        cls,
        transfer: TransferConfig,
        *,
        signer: RefitSigner | None = None,
        verifier: RefitVerifier | None = None,
    ) -> NIXLCheckpointEngine:
        """The engine a session runs with: every setting from the job's transfer config
        (upstream's positional signature stays for upstream's callers)."""
        return cls(
            transfer.bucket_size,
            device=transfer.device,
            backend_name=transfer.backend,
            backend_init_params=dict(transfer.backend_params) or None,
            shard_expert_weights=transfer.shard_expert_weights,
            timeout_s=transfer.timeout_seconds,
            checksum=transfer.checksum,
            signer=signer,
            verifier=verifier,
        )

    # -- what both roles share: the settings, the agent and its registry, the refit ids --
    @property
    def common(self) -> EngineCommon:
        """The shared part both roles read their settings from (bucket size, device,
        timeout, integrity, striping, signer and verifier), the NIXL agent and its memory
        registry once :meth:`prepare` made them, and the refit-id counter."""
        return self._common

    @property
    def targets_exposed(self) -> bool:
        """Whether the last :meth:`receive_into` let senders write into its targets (after
        a failure: whether they may hold a mix of old and new bytes)."""
        return self._kept.targets_exposed

    # -- set-up -------------------------------------------------------------------------
    @property
    def _role(self) -> Role | None:
        if self._policy is not None:
            return "policy"
        return None if self._rollout is None else "rollout"

    def set_target_weight_layout(self, layout: TargetWeightLayout | None) -> None:
        """Declare the experts / tensor-parallel slice this rollout rank holds."""
        self._layout = layout

    def get_target_weight_layout(self) -> dict[str, Any] | None:
        if self._layout is None:
            return None
        # Experts are filtered on request; declared tensor-parallel slices always travel.
        if not self.shard_expert_weights and not self._layout.slices:
            return None
        return self._layout.as_dict()

    def prepare(self) -> NixlAgentMetadata:
        """Create the agent (once) and register fresh receive buffers; return the metadata."""
        self._common.start(self.backend_name, self.backend_init_params)
        # Offered before the role is known; a policy rank frees them at its init.
        self._kept.offer(self._common, self.buffer_count)
        return self._common.agent.get_agent_metadata().model_copy(
            update={
                "mem_type": self._common.mem_type,
                "buffers": tuple(
                    BufferDesc(addr=a, length=n, dev_id=d) for a, n, d in self._kept.regions()
                ),
                "layout": self.get_target_weight_layout(),
            }
        )

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
        self._policy = PolicySide(self._common, rank=worker_rank, after=self._after_send)
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
        if not self._kept.buffers:
            raise RuntimeError("call prepare() before init_rollout_process_group()")
        self._disconnect_peers()
        self._rollout = RolloutSide(
            self._common, rank=rollout_rank, kept=self._kept, after=self._after_receive
        )
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
        side = self._policy or self._rollout
        role = self._role
        if side is None or role is None:
            raise RuntimeError("call init_policy_process_group() or init_rollout_process_group()")
        return self._common.peers.update(
            self._common.agent,
            metadata,
            role=role,
            rank=side.rank,
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            version=version,
            check=self._check_buffers,
            forgotten=self._forget_routes,
        )

    def _forget_routes(self, agent_name: str) -> None:
        if self._policy is not None:
            self._policy.forget(agent_name)
        if self._rollout is not None:
            self._rollout.forget(agent_name)

    @property
    def members(self) -> tuple[int, ...]:
        """The rollout ranks connected now (a policy rank's possible targets)."""
        return self._common.peers.members

    def _target(self, rollout_rank: int) -> Target:
        """Rollout member ``rollout_rank`` as a target of the next refit."""
        return self._common.peers.target(rollout_rank, stripe=self._common.stripe)

    def _check_buffers(self, peer: NixlAgentMetadata, rollout_rank: int) -> None:
        if (
            len(peer.buffers) < 2
            or peer.mem_type != self._common.mem_type
            or any(b.length < self._common.bucket_size for b in peer.buffers)
        ):
            raise ValueError(
                f"rollout rank {rollout_rank} offers buffers {list(peer.buffers)} in "
                f"{peer.mem_type}; need >= 2 of >= {self._common.bucket_size} bytes in "
                f"{self._common.mem_type}"
                " (same bucket_size and device on both sides?)"
            )

    # -- refits: the role's part does them -----------------------------------------------
    def _not_set_up_as(self, role: Role) -> RuntimeError:
        return RuntimeError(
            f"this engine is set up as {self._role or 'nothing'}; call "
            f"init_{role}_process_group() first"
        )

    def _policy_side(self) -> PolicySide:
        if self._policy is None:
            raise self._not_set_up_as("policy")
        return self._policy

    def _rollout_side(self) -> RolloutSide:
        if self._rollout is None:
            raise self._not_set_up_as("rollout")
        return self._rollout

    async def send_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        refit_id: int | None = None,
        delta: DeltaHeader | None = None,
        pieces: tuple[tuple[int, Box], ...] | None = None,
    ) -> RefitTiming:
        """Send all of ``weights`` to this refit's targets; return once each confirmed or
        was dropped.

        The targets are the members (see :meth:`update_peers`) this rank sends to.  A target
        that fails, declines or is dropped with :meth:`drop_target` does not fail the send:
        the returned timing lists ``delivered`` and ``dropped`` (rank -> reason); ``bytes``
        are those written to the delivered targets.  Raises only for this rank's own
        failures (bad weights, a local NIXL error).

        ``delta``: ``weights`` is the one tensor of a delta (:mod:`.delta.codec`) onto the version
        the header names; a target that lacks that version declines it and is listed in
        the timing's ``wants_whole`` (send it the refit whole).  Raises
        :class:`~.policy.side.DeltaNotApplicable` before anything is sent when a target
        reshapes what it receives.  ``pieces``: the delta of sharded senders, laid end to end
        (``(policy rank, box)`` each, :mod:`.delta.blocks`): ``weights`` is this rank's
        piece, and each rank writes only its own.
        """
        side = self._policy_side()
        return await side.send_weights(weights, refit_id=refit_id, delta=delta, pieces=pieces)

    def drop_target(self, rank: int, reason: str) -> bool:
        """Stop waiting for rollout rank ``rank`` in the send in progress (call it from the
        same event loop, e.g. a task watching the membership); it ends up in ``dropped``.
        Returns whether a send was in progress."""
        return self._policy is not None and self._policy.drop_target(rank, reason)

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
        side = self._rollout_side()  # on the first batch asked for, as a generator does
        batches = side.receive_weight_batches(
            refit_id=refit_id, min_refit=min_refit, on_complete=on_complete
        )
        async with aclosing(batches):  # a consumer that stops early closes the part's too
            async for batch in batches:
                yield batch

    async def receive_into(
        self,
        targets: Mapping[str, torch.Tensor] | TargetResolver,
        *,
        refit_id: int | None = None,
        min_refit: int | None = None,
        delta: DeltaTarget | None = None,
    ) -> ReceivedRefit:
        """Receive a refit straight into ``targets``: contiguous tensors by name.

        ``targets`` must hold exactly the sent names with the sent dtypes and shapes
        (otherwise :class:`~.rollout.refit.LayoutMismatchError`, before any byte lands), or be a
        function of the sent :class:`~.planning.buckets.TensorSpec` list returning such a mapping.
        Their memory is registered with NIXL once and stays registered while later refits
        land in it.  Returns the targets and what the refit cost once every byte arrived and
        (with ``checksum``) passed its integrity check.  If it raises instead, the targets
        may hold a mix of old and new bytes.

        ``min_refit=k``: take the first refit with id >= k that this rank's sources agree
        on; older refits (and refits whose sources disagree on the membership) are declined
        before anything lands.  ``timing.refit_id`` says which refit landed.

        ``delta``: how to take a delta refit (the version served, and what applies a delta
        onto a spare copy and checks the result); the returned ``tensors`` are then that
        spare copy and ``delta`` names the base.  Without it a delta is declined and the
        refit taken whole.
        """
        side = self._rollout_side()
        return await side.receive_into(targets, refit_id=refit_id, min_refit=min_refit, delta=delta)

    def decline_pending(self, below: int, reason: str) -> int:
        """A rollout rank that holds every refit < ``below``: decline the policy's pending
        manifests of those (see :meth:`.rollout.side.RolloutSide.decline_pending`)."""
        return self._rollout_side().decline_pending(below, reason)

    def _after_send(self) -> None:
        if self.release_after_refit:
            self._disconnect_peers()
            self._common.registry.clear()

    def _after_receive(self) -> None:
        if self.release_after_refit:
            self._common.agent.flush()
            self._disconnect_peers()
            self._release_transfer_buffers()

    # -- teardown -------------------------------------------------------------------------
    def _disconnect_peers(self) -> None:
        if self._policy is not None:
            self._policy.disconnect()  # before the peers its prepared WRITEs name
        self._policy = self._rollout = None
        self._common.peers.clear(self._common.nixl_agent)

    def _release_transfer_buffers(self) -> None:
        self._kept.release(self._common)

    def finalize(self) -> None:
        """Disconnect from all peers and free the transfer buffers (``prepare()`` redoes it)."""
        if self._common.nixl_agent is not None:
            self._common.nixl_agent.flush()  # last control messages (e.g. "done") must leave first
        self._disconnect_peers()
        self._release_transfer_buffers()
        self._common.close()


__all__ = ["NIXLCheckpointEngine", "ReceivedRefit"]
