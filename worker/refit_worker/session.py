"""``RefitSession``: the worker library's entry point for users' own trainer and server code.

A session is built from the same ``REFIT_*`` environment the operator renders
(:meth:`RefitSession.from_env`).  It owns the NIXL checkpoint engine and the rendezvous:
:meth:`connect` publishes this rank's agent metadata, waits for the barrier of its epoch
and connects to the peers; then a policy rank calls :meth:`send` with its
``named_parameters()`` and a rollout rank receives each refit straight into final,
registered tensors (no clone), verifies it (manifest completeness and integrity hashes in
the engine, plus an optional caller check) and only then commits it:

* :meth:`receive_into` ``(model, mode="double_buffer")``: into a spare copy of the model's
  tensors, committed by swapping it with the served one; readers never see a partial refit;
* :meth:`receive_into` ``(model, mode="in_place")``: straight into the live parameters while
  the server has paused generation; a refit that stops part-way raises
  :class:`PartialRefitError` (or :class:`Preempted` with ``weights_partial``): the live
  weights are then partial and must not be served until a later refit completes;
* :meth:`receive`: double-buffered into the session's own state, :attr:`committed`.

:class:`RefitStats` times only the transfer and the commit: from the moment the transfer
could start (landing memory ready, senders told) to the commit, leaving out waiting for the
peer, weight generation, the caller's ``verify`` and control work (``control_seconds``).

Every transfer runs beside a watcher that stops it at the next bucket boundary when this
process got the preemption signal or the job posted a preemption notice; the call then
raises :class:`Preempted`.

Must not import: the operator, kubernetes (the store does that lazily).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from refit_worker.checkpoint_engines import (
    LayoutMismatchError,
    NIXLCheckpointEngine,
    ReceivedRefit,
    RefitTiming,
)
from refit_worker.checkpoint_engines.base import dtype_from_name
from refit_worker.checkpoint_engines.planning import TensorSpec
from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.entries import Verification
from refit_worker.contract.failures import RefusedConfigError
from refit_worker.rendezvous import (
    Member,
    Preempted,
    RendezvousStore,
    WaitCancelled,
    open_store,
)
from refit_worker.rendezvous.watch import PreemptionWatch
from refit_worker.reporting import ProgressReporter
from refit_worker.targets import (
    DoubleBuffer,
    OwnState,
    PartialRefitError,
    ReceiveMode,
    Target,
    check_mode,
    live_tensors,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

#: How often a transfer's watcher looks for a signal or a preemption notice.
WATCH_INTERVAL_S = 0.2

StateDict = dict[str, torch.Tensor]
Verifier = Callable[[int, StateDict], None]


@dataclass(frozen=True)
class RefitStats:
    """One refit as this rank saw it.

    ``seconds`` covers the transfer and the commit only: from the moment the transfer could
    start (a rollout rank: its landing memory was ready and it told the senders so; a
    policy rank: every receiver was ready) to the commit (a policy rank: every receiver
    confirmed).  Not included: waiting for the peer to start, generating or loading the
    weights, the caller's ``verify``, and control work before the transfer (checks, the
    first refit's allocation and registration of landing memory): ``control_seconds``.
    """

    refit_id: int
    #: Bytes this rank moved, as its engine counted them: a rollout rank, what landed; a
    #: policy rank, what it wrote, to each of its targets.
    bytes: int
    seconds: float
    #: Control work of the refit (checks, plans, allocating and registering memory).
    control_seconds: float = 0.0
    #: NIXL registrations the refit made (0 once memory is reused refit after refit).
    registrations: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class CommittedRefit:
    refit_id: int
    state: StateDict


class _Flag:
    """A stop callable seen as a cancel flag for the store's waits."""

    def __init__(self, requested: Callable[[], bool]) -> None:
        self._requested = requested

    def is_set(self) -> bool:
        return self._requested()


class RefitSession:
    """One rank's side of a RefitJob: connect once per epoch, then send or receive refits."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        store: RendezvousStore | None = None,
        stop_requested: Callable[[], bool] = lambda: False,
    ) -> None:
        if config.transfer.release_after_refit:
            raise RefusedConfigError(
                "transfer.releaseAfterRefit is not supported by RefitSession yet: it would "
                "need a metadata exchange per refit; use NIXLCheckpointEngine directly"
            )
        self.config = config
        self.member = Member.from_config(config)
        self.store = store if store is not None else open_store(config)
        self._stop_requested = stop_requested
        self._engine: NIXLCheckpointEngine | None = None
        self._committed: CommittedRefit | None = None
        self._own = OwnState()
        self._doubles: dict[int, DoubleBuffer] = {}  # by id() of the caller's target
        self._released: Any = None  # CUDA event: readers of the spare copy are done
        self._partial = False
        #: This rank's progress reports: every refit sent or committed is published.
        self.reporter = ProgressReporter(self.store, self.member, config)
        # One long watch for the job-wide notice instead of a read per check: a thousand
        # ranks polling the ConfigMap would load the API server for nothing.
        self._watch = PreemptionWatch(self.store, self.member, lambda notice: None)

    @classmethod
    def from_env(cls, **kwargs: Any) -> RefitSession:
        """A session for the rank described by this process's ``REFIT_*`` environment."""
        return cls(WorkerConfig.from_env(), **kwargs)

    @property
    def committed(self) -> CommittedRefit | None:
        """The last refit received in full and verified (rollout ranks), else None."""
        return self._committed

    # -- set-up -----------------------------------------------------------------------

    def connect(self) -> None:
        """Publish metadata, wait for the barrier of this epoch, connect to the peers.

        A gang recreated after the last refit was committed (a drain that met the final
        commit) has nothing to move: it connects to no one, so no rank reaches for a peer
        that already finished and left; ``reporter.finish()`` then reports it done."""
        cfg, transfer = self.config, self.config.transfer
        if not self.pending_refits:
            log.info(
                "%s rank %d (epoch %d): all %d refits were committed in earlier epochs;"
                " nothing to connect for",
                cfg.role,
                cfg.rank,
                cfg.epoch,
                transfer.refits,
            )
            return
        engine = NIXLCheckpointEngine(
            transfer.bucket_size,
            device=transfer.device,
            backend_name=transfer.backend,
            backend_init_params=dict(transfer.backend_params) or None,
            shard_expert_weights=transfer.shard_expert_weights,
            timeout_s=transfer.timeout_seconds,
            checksum=transfer.checksum,
        )
        try:
            metadata = engine.prepare()
            self.store.publish_metadata(self.member, metadata.model_dump_json())
            # A pod stopped while its peers never came (one was killed at start-up) must
            # not sit out the whole timeout: its grace period is usually shorter.
            barrier = self.store.wait_barrier(
                self.member, transfer.timeout_seconds, cancel=_Flag(self._stop_requested)
            )
            peers = self.store.peers(self.member, barrier)
            ordered = [peers[("policy", r)].agent for r in range(cfg.policy_world_size)]
            ordered += [peers[("rollout", r)].agent for r in range(cfg.rollout_world_size)]
            if cfg.role == "policy":
                engine.init_policy_process_group(
                    worker_rank=cfg.rank,
                    train_world_size=cfg.policy_world_size,
                    rollout_world_size=cfg.rollout_world_size,
                    metadata=ordered,
                )
            else:
                engine.init_rollout_process_group(
                    rollout_rank=cfg.rank,
                    train_world_size=cfg.policy_world_size,
                    rollout_world_size=cfg.rollout_world_size,
                    metadata=ordered,
                )
        except WaitCancelled as exc:
            engine.finalize()
            raise Preempted(
                f"{cfg.role} rank {cfg.rank}: stop requested while waiting for "
                f"the barrier of epoch {cfg.epoch}"
            ) from exc
        except BaseException:
            engine.finalize()
            raise
        self._engine = engine
        self._watch.start()

    def close(self) -> None:
        """Disconnect and free the engine's buffers, and close the store; idempotent."""
        self._watch.stop()
        if self._engine is not None:
            self._engine.finalize()
            self._engine = None
        self.store.close()

    def __enter__(self) -> RefitSession:
        self.connect()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Say how this rank stopped before it goes, so the job's status can tell.
        if exc_type is not None and issubclass(exc_type, Preempted):
            self.reporter.publish("preempted", str(exc[0])[:200])
        elif exc_type is not None and issubclass(exc_type, Exception):
            self.reporter.publish("failed", f"{exc_type.__name__}: {exc[0]}"[:200])
        elif exc_type is None:
            self.reporter.finish()
        self.close()

    @property
    def pending_refits(self) -> range:
        """The refit ids this gang still has to move: from where a recreated gang resumes
        (``first_refit``) to the job's ``refits``.  Loop over it, and the job's status,
        ``refit run``'s table and a resumed gang all agree on what was done."""
        return range(self.reporter.log.refits_completed, self.config.transfer.refits)

    # -- refits -----------------------------------------------------------------------

    @property
    def live_weights_partial(self) -> bool:
        """Whether an in-place refit stopped part-way and no later one completed."""
        return self._partial

    async def send(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, refit_id: int
    ) -> RefitStats:
        """Stream ``weights`` (e.g. ``model.named_parameters()``) as refit ``refit_id``.

        DTensor weights (FSDP2, tensor parallel) are sent shard by shard: this rank writes
        only its own blocks (no ``full_tensor()``, no collective on the trainer's group), and
        the stats count only those bytes; see docs/trainers.md.
        """
        engine = self._require("policy")
        items = [(name, tensor.detach()) for name, tensor in weights]
        timing = await self._watched(engine.send_weights(iter(items), refit_id=refit_id))
        self.reporter.refit(refit_id, timing.bytes, timing.seconds, None)
        return RefitStats(
            refit_id, timing.bytes, timing.seconds, timing.control_s, timing.registrations
        )

    async def receive(
        self,
        *,
        refit_id: int,
        verify: Verifier | None = None,
        verified_as: Verification | None = None,
    ) -> RefitStats:
        """Receive refit ``refit_id`` into the session's own state, verify it, commit it.

        Double-buffered: the refit lands in a spare copy (allocated when the first refit's
        manifest arrives, the second right after that refit's commit, again when the
        layout changes; registered once); the commit makes it
        :attr:`committed` and keeps the previously committed memory as the next spare.  So
        ``committed.state`` of refit ``k`` stays valid until refit ``k + 2`` starts; copy
        out of it (or use :meth:`receive_into`) to keep it longer.

        ``verified_as`` names what ``verify`` checks (e.g. ``"bit-exact"``) for the job's
        status; without it the status claims only what the engine checked itself.
        """
        engine = self._require("rollout")
        device = engine.device

        def resolve(specs: Sequence[TensorSpec]) -> Mapping[str, torch.Tensor]:
            shapes = {s.name: (s.shape, dtype_from_name(s.dtype)) for s in specs}
            return self._own.spare(shapes, device)

        landed = await self._land(engine, resolve, refit_id, partial=False)
        if verify is not None:
            verify(refit_id, dict(landed.tensors))
        started = time.perf_counter()
        self._commit(refit_id, self._own.swap())
        stats = self._stats(landed.timing, time.perf_counter() - started, verified_as)
        # Set up the second copy now, between refits, not while the next one streams in
        # (once: from then on the two copies take turns).
        self._own.spare(self._own.layout(), device)
        return stats

    async def receive_into(
        self,
        target: Target,
        *,
        refit_id: int,
        mode: ReceiveMode = "double_buffer",
        verify: Verifier | None = None,
        verified_as: Verification | None = None,
    ) -> RefitStats:
        """Receive refit ``refit_id`` into ``target`` (an ``nn.Module`` or a state dict).

        ``mode="double_buffer"``: into a spare copy of ``target``'s tensors, then swapped in
        (a module's parameters point at the new memory, a mapping's values are replaced);
        on any failure ``target`` is untouched.  ``mode="in_place"``: straight into
        ``target``'s tensors; pause whatever reads them first.  On a failure after the
        first byte could land this raises :class:`PartialRefitError` (a preemption:
        :class:`Preempted` with ``weights_partial=True``) and :attr:`live_weights_partial`
        turns true: do not serve those weights until a later refit completes.

        The names, dtypes and shapes of ``target`` must match what the policy sends,
        else :class:`~refit_worker.checkpoint_engines.LayoutMismatchError` before any byte
        lands.  ``verify(refit_id, tensors)`` runs on the filled tensors before the commit.
        """
        engine = self._require("rollout")
        mode = check_mode(mode)
        if mode == "in_place":

            def in_place(specs: Sequence[TensorSpec]) -> Mapping[str, torch.Tensor]:
                return live_tensors(target, [s.name for s in specs])

            landed = await self._land(engine, in_place, refit_id, partial=True)
            self._check(verify, refit_id, landed.tensors, partial=True)
            started = time.perf_counter()
            self._partial = False
            self._commit(refit_id, dict(landed.tensors))
            return self._stats(landed.timing, time.perf_counter() - started, verified_as)
        double = self._doubles.get(id(target))
        if double is None or double.target is not target:
            double = self._doubles[id(target)] = DoubleBuffer(target)
        # The spare was served until the last swap: CUDA kernels may still read it.
        if self._released is not None:
            self._released.synchronize()

        def spare(specs: Sequence[TensorSpec]) -> Mapping[str, torch.Tensor]:
            return double.spare([s.name for s in specs])

        landed = await self._land(engine, spare, refit_id, partial=False)
        self._check(verify, refit_id, landed.tensors, partial=False)
        started = time.perf_counter()
        self._commit(refit_id, double.swap())
        return self._stats(landed.timing, time.perf_counter() - started, verified_as)

    async def _land(
        self,
        engine: NIXLCheckpointEngine,
        targets: Callable[[Sequence[TensorSpec]], Mapping[str, torch.Tensor]],
        refit_id: int,
        *,
        partial: bool,
    ) -> ReceivedRefit:
        """Receive into ``targets``; an in-place failure after landing began says so."""
        who = f"rollout rank {self.config.rank}: refit {refit_id}"
        try:
            return await self._watched(engine.receive_into(targets, refit_id=refit_id))
        except LayoutMismatchError:
            raise  # refused before any byte landed: nothing changed
        except Preempted as exc:
            if partial and engine.targets_exposed:
                self._partial = True
                raise Preempted(
                    f"{exc}; the in-place refit {refit_id} stopped part-way, so the live "
                    "weights are partial: do not serve them",
                    weights_partial=True,
                ) from exc
            raise
        except Exception as exc:
            if partial and engine.targets_exposed:
                self._partial = True
                raise PartialRefitError(
                    f"{who} failed part-way ({type(exc).__name__}: {exc}); the live weights "
                    "now mix two refits: do not serve them until a later refit completes"
                ) from exc
            raise

    def _check(
        self,
        verify: Verifier | None,
        refit_id: int,
        filled: Mapping[str, torch.Tensor],
        *,
        partial: bool,
    ) -> None:
        if verify is None:
            return
        try:
            verify(refit_id, dict(filled))
        except Exception as exc:
            if not partial:
                raise
            self._partial = True
            raise PartialRefitError(
                f"rollout rank {self.config.rank}: refit {refit_id} landed in place but failed "
                f"verification ({type(exc).__name__}: {exc}); do not serve the live weights"
            ) from exc

    def _commit(self, refit_id: int, state: StateDict) -> None:
        self._committed = CommittedRefit(refit_id, state)  # one assignment: atomic to readers
        engine = self._engine
        if engine is not None and engine.device.type == "cuda":
            # Readers queued on the old copy must finish before a refit refills it.
            self._released = torch.cuda.current_stream(engine.device).record_event()

    def _stats(
        self, timing: RefitTiming, commit_s: float, verified_as: Verification | None
    ) -> RefitStats:
        """The committed refit's figures, published as this rank's progress."""
        stats = RefitStats(
            timing.refit_id,
            timing.bytes,
            timing.seconds + commit_s,
            timing.control_s,
            timing.registrations,
        )
        self.reporter.refit(stats.refit_id, stats.bytes, stats.seconds, verified_as)
        return stats

    def preemption_pending(self) -> bool:
        """Whether this process got the signal or the job posted a preemption notice."""
        if self._stop_requested() or self._watch.notice is not None:
            return True
        if self._watch.error is not None:
            # The watch lost the store; ask directly (this raises if the store is gone).
            return self.store.preemption_notice(self.member) is not None
        return False

    async def _watched(self, transfer: Awaitable[T]) -> T:
        task = asyncio.ensure_future(transfer)
        while True:
            done, _ = await asyncio.wait({task}, timeout=WATCH_INTERVAL_S)
            if done:
                return task.result()
            if await asyncio.to_thread(self.preemption_pending):
                task.cancel()
                # Bounded: cancellation lands at the engine's next await (a bucket boundary).
                await asyncio.wait({task}, timeout=self.config.transfer.timeout_seconds)
                raise Preempted(
                    f"{self.config.role} rank {self.config.rank}: stopped at a "
                    "bucket boundary for a preemption"
                )

    def _require(self, role: str) -> NIXLCheckpointEngine:
        if self._engine is None:
            raise RuntimeError("RefitSession is not connected: call connect() first")
        if self.config.role != role:
            raise RuntimeError(f"only a {role} rank can do that; this is a {self.config.role} rank")
        return self._engine


__all__ = [
    "CommittedRefit",
    "PartialRefitError",
    "Preempted",
    "RefitSession",
    "RefitStats",
    "StateDict",
    "Verifier",
]
