"""``RefitSession``: the worker library's entry point for users' own trainer and server code.

A session is built from the same ``REFIT_*`` environment the operator renders
(:meth:`RefitSession.from_env`).  It owns the NIXL checkpoint engine and the rendezvous:
:meth:`connect` publishes this rank's agent metadata, waits for the barrier of its epoch
and connects to the peers; then a policy rank calls :meth:`send` with its
``named_parameters()`` and a rollout rank calls :meth:`receive`, which stages the refit,
verifies it (manifest completeness in the engine, plus an optional caller check) and only
then commits it: :attr:`committed` never shows a half-received refit.

Every transfer runs beside a watcher that stops it at the next bucket boundary when this
process got the preemption signal or the job posted a preemption notice; the call then
raises :class:`Preempted`.

Must not import: the operator, kubernetes (the store does that lazily).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from refit_worker.checkpoint_engines import NIXLCheckpointEngine
from refit_worker.contract.config import WorkerConfig
from refit_worker.rendezvous import (
    Member,
    PreemptedError,
    RendezvousStore,
    WaitCancelled,
    open_store,
)
from refit_worker.rendezvous.watch import PreemptionWatch

T = TypeVar("T")

#: How often a transfer's watcher looks for a signal or a preemption notice.
WATCH_INTERVAL_S = 0.2

StateDict = dict[str, torch.Tensor]
Verifier = Callable[[int, StateDict], None]


class Preempted(Exception):
    """The job is being preempted; stop at this safe point and exit as preempted."""


@dataclass(frozen=True)
class RefitStats:
    refit_id: int
    bytes: int
    seconds: float

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
            raise ValueError(
                "transfer.releaseAfterRefit is not supported by RefitSession yet: it would "
                "need a metadata exchange per refit; use NIXLCheckpointEngine directly"
            )
        self.config = config
        self.member = Member.from_config(config)
        self.store = store if store is not None else open_store(config)
        self._stop_requested = stop_requested
        self._engine: NIXLCheckpointEngine | None = None
        self._committed: CommittedRefit | None = None
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
        """Publish metadata, wait for the barrier of this epoch, connect to the peers."""
        cfg, transfer = self.config, self.config.transfer
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
        except PreemptedError as exc:
            engine.finalize()
            raise Preempted(str(exc)) from exc
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

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- refits -----------------------------------------------------------------------

    async def send(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, refit_id: int
    ) -> RefitStats:
        """Stream ``weights`` (e.g. ``model.named_parameters()``) as refit ``refit_id``."""
        engine = self._require("policy")
        items = [(name, tensor.detach()) for name, tensor in weights]
        nbytes = sum(t.numel() * t.element_size() for _, t in items)
        started = time.perf_counter()
        await self._watched(engine.send_weights(iter(items), refit_id=refit_id))
        return RefitStats(refit_id, nbytes, time.perf_counter() - started)

    async def receive(self, *, refit_id: int, verify: Verifier | None = None) -> RefitStats:
        """Receive refit ``refit_id`` into a staging area, verify it, then commit it."""
        engine = self._require("rollout")
        staged: StateDict = {}
        started = time.perf_counter()

        async def stage() -> None:
            async for batch in engine.receive_weight_batches(refit_id=refit_id):
                for name, view in batch:
                    # The views alias a receive buffer that the next bucket reuses.
                    staged[name] = view.clone()

        await self._watched(stage())
        seconds = time.perf_counter() - started
        if verify is not None:
            verify(refit_id, staged)
        self._committed = CommittedRefit(refit_id, staged)  # one assignment: atomic to readers
        nbytes = sum(t.numel() * t.element_size() for t in staged.values())
        return RefitStats(refit_id, nbytes, seconds)

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
