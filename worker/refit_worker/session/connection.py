"""What both roles' sessions share: one rank's connection to its RefitJob.

:class:`Connection` holds the engine, the rendezvous store, the peers this rank follows,
the progress reporter and the preemption watch, and does the work every rank does the
same way: publish this rank's NIXL metadata, wait for its place in the membership (stopped
soon after a stop request), run a transfer beside a watcher, say how the rank ended, and
close.  It holds no state of either role: :class:`~refit_worker.policy.policy_session.PolicySession`
and :class:`~refit_worker.rollout.rollout_session.RolloutSession` each own one and keep their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.entries import BarrierEntry, SeedPointer
from refit_worker.contract.failures import RefusedConfigError
from refit_worker.engine import NIXLCheckpointEngine, TargetWeightLayout
from refit_worker.rendezvous import (
    Member,
    Preempted,
    RendezvousStore,
    WaitCancelled,
    open_store,
)
from refit_worker.rendezvous.watch import PreemptionWatch
from refit_worker.session.following import PeerSet
from refit_worker.session.job_keys import signer_of, verifier_of
from refit_worker.session.refits import Removed, Superseded, _Flag
from refit_worker.session.reporting import ProgressReporter

log = logging.getLogger(__name__)
T = TypeVar("T")

#: How often a transfer's watcher looks for a signal or a preemption notice.
WATCH_INTERVAL_S = 0.2
#: How often a transfer's watcher re-reads the membership (a ConfigMap GET each time).
MEMBERSHIP_INTERVAL_S = 1.0

MembershipCheck = Callable[[], Awaitable[None]]


class Connection:
    """One rank's engine, store, peers and reports (see the module docstring)."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        store: RendezvousStore | None = None,
        stop_requested: Callable[[], bool] = lambda: False,
        target_layout: TargetWeightLayout | None = None,
    ) -> None:
        if config.transfer.release_after_refit:
            raise RefusedConfigError(
                "transfer.releaseAfterRefit is not supported by RefitSession yet: it would "
                "need a metadata exchange per refit; use NIXLCheckpointEngine directly"
            )
        self.config = config
        self.member = Member.from_config(config)
        self.store = store if store is not None else open_store(config)
        self.stop_requested = stop_requested
        #: The part of the model this (rollout) rank holds, published with its metadata.
        self.target_layout = target_layout
        #: That layout as this rank's metadata carries it (None: it carries none).
        self.published_layout: dict[str, Any] | None = None
        self.agent_json = ""  # this rank's NIXL agent metadata, as published
        #: Where peers may seed from this (rollout) rank, published with the metadata.
        self.seed: SeedPointer | None = None
        self._engine: NIXLCheckpointEngine | None = None
        self._peers: PeerSet | None = None
        #: This rank's progress reports: every refit sent or committed is published.
        self.reporter = ProgressReporter(self.store, self.member, config)
        # One long watch for the job-wide notice instead of a read per check: a thousand
        # ranks polling the ConfigMap would load the API server for nothing.
        self._watch = PreemptionWatch(self.store, self.member, lambda notice: None)

    @property
    def engine(self) -> NIXLCheckpointEngine:
        if self._engine is None:
            raise RuntimeError("RefitSession is not connected: call connect() first")
        return self._engine

    @property
    def peers(self) -> PeerSet:
        if self._peers is None:
            raise RuntimeError("RefitSession is not connected: call connect() first")
        return self._peers

    @property
    def connected(self) -> bool:
        return self._engine is not None

    @property
    def pending_refits(self) -> range:
        """From the last refit this rank sent or committed + 1 to the job's ``refits``."""
        return range(self.reporter.log.refits_completed, self.config.transfer.refits)

    def open(self, join: Callable[[PeerSet], None]) -> None:
        """Make the engine, publish its metadata, then ``join`` the membership through the
        peer set (a policy rank waits for the barrier, a rollout rank for its place); on
        any failure the engine is freed and nothing stays published as connected."""
        engine = NIXLCheckpointEngine.from_config(
            self.config.transfer, signer=signer_of(self.config), verifier=verifier_of(self.config)
        )
        engine.set_target_weight_layout(self.target_layout)
        self.published_layout = engine.get_target_weight_layout()
        try:
            self.agent_json = engine.prepare().model_dump_json()
            self.publish()
            self._peers = PeerSet(self.store, engine, self.config)
            join(self._peers)
        except BaseException:
            engine.finalize()
            raise
        self._engine = engine
        self._watch.start()

    def publish(self) -> None:
        """Publish this rank's metadata (and seed offer) under its epoch's key."""
        self.store.publish_metadata(self.member, self.agent_json, self.seed)

    def wait(self, wait: Callable[..., BarrierEntry], what: str) -> BarrierEntry:
        """A store wait for this rank's membership, stopped soon after a stop request: a
        pod stopped while its peers never came must not sit out the whole timeout (its
        grace period is usually shorter)."""
        try:
            return wait(
                self.member,
                self.config.transfer.timeout_seconds,
                cancel=_Flag(self.stop_requested),
            )
        except WaitCancelled as exc:
            raise Preempted(
                f"{self.config.role} rank {self.config.rank}: stop requested while waiting "
                f"for {what} of epoch {self.member.epoch}"
            ) from exc

    def switch_epoch(self, epoch: int) -> None:
        """From now on this (rollout) rank is of policy epoch ``epoch``: its reports go out
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

    def preemption_pending(self) -> bool:
        """Whether this process got the signal or the job posted a preemption notice
        that stops this rank's role."""
        if self.stop_requested():
            return True
        notice = self._watch.notice
        if notice is None and self._watch.error is not None:
            # The watch lost the store; ask directly (this raises if the store is gone).
            notice = self.store.preemption_notice(self.member)
        return notice is not None and notice.role in (None, self.config.role)

    async def watched(self, transfer: Awaitable[T], membership: MembershipCheck | None = None) -> T:
        """Run ``transfer``, stopping it at a bucket boundary for a preemption; every
        :data:`MEMBERSHIP_INTERVAL_S` also run ``membership``, which acts on a newer
        barrier (drops targets) or raises to abandon the transfer."""
        task = asyncio.ensure_future(transfer)
        checked = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=WATCH_INTERVAL_S)
                if done:
                    return task.result()
                if await asyncio.to_thread(self.preemption_pending):
                    raise Preempted(
                        f"{self.config.role} rank {self.config.rank}: stopped at a "
                        "bucket boundary for a preemption"
                    )
                if membership is not None and time.monotonic() - checked >= MEMBERSHIP_INTERVAL_S:
                    checked = time.monotonic()
                    await membership()
        except BaseException:
            # Also when this call is cancelled: the transfer must not go on landing alone.
            if not task.done():
                task.cancel()
                # Bounded: cancellation lands at the engine's next await (a bucket boundary).
                await asyncio.wait({task}, timeout=self.config.transfer.timeout_seconds)
            raise

    def report_end(self, exc_type: type[BaseException] | None, exc: BaseException | None) -> None:
        """Say how this rank stopped, so the job's status can tell; a stale pod says
        nothing: the rank's progress key is its replacement's."""
        if exc_type is not None and issubclass(exc_type, Superseded):
            pass
        elif exc_type is not None and issubclass(exc_type, Removed):
            self.reporter.publish("left", str(exc)[:200])
        elif exc_type is not None and issubclass(exc_type, Preempted):
            self.reporter.publish("preempted", str(exc)[:200])
        elif exc_type is not None and issubclass(exc_type, Exception):
            self.reporter.publish("failed", f"{exc_type.__name__}: {exc}"[:200])
        elif exc_type is None:
            self.reporter.finish()

    def close(self) -> None:
        """Disconnect and free the engine's buffers, and close the store; idempotent."""
        self._watch.stop()
        if self._engine is not None:
            self._engine.finalize()
            self._engine = None
        self.store.close()
