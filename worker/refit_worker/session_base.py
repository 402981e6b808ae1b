"""The shared core of :class:`~refit_worker.session.RefitSession`: set-up, membership
of the epoch, the transfer watcher, and how a rank's end is reported.

:class:`SessionBase` holds the engine, the store, the progress reporter and the
preemption watch; :mod:`.sending` (policy ranks) and :mod:`.receiving` (rollout ranks)
build on it, and :class:`~refit_worker.session.RefitSession` is the two together.

Must not import: the operator, kubernetes (the store does that lazily).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Self, TypeVar

import torch.distributed as dist

from refit_worker.checkpoint_engines import (
    NIXLCheckpointEngine,
)
from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.entries import BarrierEntry
from refit_worker.contract.failures import RefusedConfigError
from refit_worker.following import PeerSet
from refit_worker.gang import PolicyGang, join_policy_group
from refit_worker.refits import (
    CommittedRefit,
    Removed,
    Superseded,
    _Flag,
)
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
)
from refit_worker.waits import Backoff

log = logging.getLogger(__name__)
T = TypeVar("T")

#: How often a transfer's watcher looks for a signal or a preemption notice.
WATCH_INTERVAL_S = 0.2
#: How often a transfer's watcher re-reads the membership (a ConfigMap GET each time).
MEMBERSHIP_INTERVAL_S = 1.0
#: How often a lingering policy rank re-reads the membership and the ranks' progress.
LINGER_INTERVAL_S = 0.5

MembershipCheck = Callable[[], Awaitable[None]]
_MOVED_POLL = Backoff(first=0.05, cap=1.0)


class _Rejoin(Exception):
    """The membership moved on under a refit in flight (a new policy epoch, or this rank
    is no longer listed): abandon it and look again."""


class SessionBase:
    """One rank's side of a RefitJob: connect once, then send or receive refits.

    A policy rank follows the rollout membership refit by refit (members come and go
    without a restart); a rollout rank follows the policy epochs (a policy restart is
    joined without a restart of its own)."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        store: RendezvousStore | None = None,
        stop_requested: Callable[[], bool] = lambda: False,
        group: dist.ProcessGroup | None = None,
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
        self._peers: PeerSet | None = None
        #: A policy rank's group (None: the default one), where rank 0 hands out each
        #: refit's membership (:mod:`refit_worker.gang`).
        self._group = group
        self._gang: PolicyGang | None = None
        self._agent_json = ""  # this rank's NIXL agent metadata, as published
        #: A policy rank: the last refit it sent, and the (rank, uid) that confirmed it.
        self._last_sent: tuple[int, set[tuple[int, str]]] | None = None
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
        if cfg.role == "policy":
            if self._group is None and cfg.policy_world_size > 1 and not dist.is_initialized():
                # Code of the user's own that has no torch.distributed group (the README's
                # trainer): the ranks still need one to agree on each refit's plan.
                join_policy_group(cfg)
                log.info(
                    "policy rank %d: joined the policy ranks' torch.distributed group at "
                    "%s:%d as the default group (no group was given or initialized)",
                    cfg.rank,
                    cfg.master_addr,
                    cfg.master_port,
                )
            # Before anything is published: a gang that cannot agree must not start.
            self._gang = PolicyGang(self._group, world_size=cfg.policy_world_size)
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
            self._agent_json = engine.prepare().model_dump_json()
            self.store.publish_metadata(self.member, self._agent_json)
            self._peers = PeerSet(self.store, engine, cfg)
            if cfg.role == "policy":
                # The members may come later (or go): each send reads them again.
                self._peers.connect(self._wait(self.store.wait_barrier, "the barrier"))
            else:
                self._join(self._wait(self.store.wait_membership, "the barrier"))
        except BaseException:
            engine.finalize()
            raise
        self._engine = engine
        self._watch.start()

    def _wait(self, wait: Callable[..., BarrierEntry], what: str) -> BarrierEntry:
        """A store wait for this rank's membership, stopped soon after a stop request: a
        pod stopped while its peers never came must not sit out the whole timeout (its
        grace period is usually shorter)."""
        try:
            return wait(
                self.member,
                self.config.transfer.timeout_seconds,
                cancel=_Flag(self._stop_requested),
            )
        except WaitCancelled as exc:
            raise Preempted(
                f"{self.config.role} rank {self.config.rank}: stop requested while waiting "
                f"for {what} of epoch {self.member.epoch}"
            ) from exc

    def _join(self, barrier: BarrierEntry) -> None:
        """Take this rollout rank's place in ``barrier`` (of its epoch or a later one: a
        new policy epoch) and connect to that epoch's policy ranks."""
        if barrier.epoch != self.member.epoch:
            self._switch_epoch(barrier.epoch)
        self._require_peers().connect(barrier)

    def _switch_epoch(self, epoch: int) -> None:
        """From now on this rollout rank is of policy epoch ``epoch``: its reports go out
        under it, and the preemption notice to heed is that epoch's."""
        log.info(
            "rollout rank %d: joining policy epoch %d (was %d)",
            self.config.rank,
            epoch,
            self.member.epoch,
        )
        self.member = dataclasses.replace(self.member, epoch=epoch)
        self.reporter.member = self.member
        self._watch.stop()
        self._watch = PreemptionWatch(self.store, self.member, lambda notice: None)
        if self._engine is not None:
            self._watch.start()

    def close(self) -> None:
        """Disconnect and free the engine's buffers, and close the store; idempotent."""
        self._watch.stop()
        if self._engine is not None:
            self._engine.finalize()
            self._engine = None
        self.store.close()

    def __enter__(self) -> Self:
        self.connect()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Say how this rank stopped before it goes, so the job's status can tell; a stale
        # pod says nothing: the rank's progress key is its replacement's.
        if exc_type is not None and issubclass(exc_type, Superseded):
            pass
        elif exc_type is not None and issubclass(exc_type, Removed):
            self.reporter.publish("left", str(exc[0])[:200])
        elif exc_type is not None and issubclass(exc_type, Preempted):
            self.reporter.publish("preempted", str(exc[0])[:200])
        elif exc_type is not None and issubclass(exc_type, Exception):
            self.reporter.publish("failed", f"{exc_type.__name__}: {exc[0]}"[:200])
        elif exc_type is None:
            self.reporter.finish()
        self.close()

    @property
    def pending_refits(self) -> range:
        """The refit ids this rank still has to move: from the last one it sent or
        committed + 1 (at the start, ``first_refit``: where a recreated gang or a
        replacement resumes) to the job's ``refits``.  Evaluated anew on each access: a
        rollout rank that joined late skips the refits it missed, so loop with
        ``while session.pending_refits: await session.receive()``; a policy rank may
        ``for refit in session.pending_refits``."""
        return range(self.reporter.log.refits_completed, self.config.transfer.refits)

    # -- refits -----------------------------------------------------------------------

    @property
    def live_weights_partial(self) -> bool:
        """Whether an in-place refit stopped part-way and no later one completed."""
        return self._partial

    def preemption_pending(self) -> bool:
        """Whether this process got the signal or the job posted a preemption notice
        that stops this rank's role (a notice for the policy gang alone leaves rollout
        ranks serving: they join the next epoch)."""
        if self._stop_requested():
            return True
        notice = self._watch.notice
        if notice is None and self._watch.error is not None:
            # The watch lost the store; ask directly (this raises if the store is gone).
            notice = self.store.preemption_notice(self.member)
        return notice is not None and notice.role in (None, self.config.role)

    async def _watched(
        self, transfer: Awaitable[T], membership: MembershipCheck | None = None
    ) -> T:
        """Run ``transfer``, stopping it at a bucket boundary for a preemption; every
        :data:`MEMBERSHIP_INTERVAL_S` also run ``membership``, which acts on a newer
        barrier (drops targets) or raises to abandon the transfer."""
        task = asyncio.ensure_future(transfer)
        checked = time.monotonic()
        while True:
            done, _ = await asyncio.wait({task}, timeout=WATCH_INTERVAL_S)
            if done:
                return task.result()
            try:
                if await asyncio.to_thread(self.preemption_pending):
                    raise Preempted(
                        f"{self.config.role} rank {self.config.rank}: stopped at a "
                        "bucket boundary for a preemption"
                    )
                if membership is not None and time.monotonic() - checked >= MEMBERSHIP_INTERVAL_S:
                    checked = time.monotonic()
                    await membership()
            except BaseException:
                task.cancel()
                # Bounded: cancellation lands at the engine's next await (a bucket boundary).
                await asyncio.wait({task}, timeout=self.config.transfer.timeout_seconds)
                raise

    def _require_peers(self) -> PeerSet:
        if self._peers is None:
            raise RuntimeError("RefitSession is not connected: call connect() first")
        return self._peers

    def _require_gang(self) -> PolicyGang:
        if self._gang is None:
            raise RuntimeError("RefitSession is not connected: call connect() first")
        return self._gang

    def _require(self, role: str) -> NIXLCheckpointEngine:
        if self._engine is None:
            raise RuntimeError("RefitSession is not connected: call connect() first")
        if self.config.role != role:
            raise RuntimeError(f"only a {role} rank can do that; this is a {self.config.role} rank")
        return self._engine
