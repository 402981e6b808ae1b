""":class:`RolloutSession`: a rollout rank's session.  It receives each refit into the
session's state or the caller's target, verifies and commits it, and follows the
membership (a new policy epoch, a scale-down, a stale pod).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from refit_worker.contract.entries import (
    BarrierEntry,
    ServedVersion,
    Verification,
    decode_entry,
)
from refit_worker.contract.roles import Role
from refit_worker.contract.waits import Backoff, poll_until
from refit_worker.engine import (
    DeltaTarget,
    LayoutMismatchError,
    NIXLCheckpointEngine,
    ReceivedRefit,
    RefitTiming,
    TensorSpec,
    dtype_from_name,
)
from refit_worker.rendezvous import (
    Preempted,
    RendezvousTimeout,
    WaitCancelled,
)
from refit_worker.rollout.delta_base import DeltaBase
from refit_worker.rollout.peer_seeds import PeerSeeds
from refit_worker.rollout.seed_choice import process_started_at, successor
from refit_worker.rollout.targets import (
    DoubleBuffer,
    OwnState,
    PartialRefitError,
    ReceiveMode,
    Target,
    check_mode,
    live_tensors,
)
from refit_worker.session.following import PeerSet, standing
from refit_worker.session.refit_session import RefitSession
from refit_worker.session.refits import (
    CommittedRefit,
    DeltaChanges,
    RefitStats,
    Removed,
    StateDict,
    Superseded,
    Verifier,
    _Flag,
)
from refit_worker.session.reporting import checked_level
from refit_worker.session.rollout_reports import all_done

log = logging.getLogger(__name__)

_MOVED_POLL = Backoff(first=0.05, cap=1.0)


class _Rejoin(Exception):
    """The membership moved on under a refit in flight (a new policy epoch, or this rank
    is no longer listed): abandon it and look again."""


class _PolicyDone(Exception):
    """The policy ranks finished and left late members to the rollout peers that stay:
    the send this rank waits for will not come; a peer seeds the refit instead."""


class RolloutSession(RefitSession):
    """Receiving refits (rollout ranks); see the module docstring."""

    role: ClassVar[Role] = "rollout"

    def _init_role(self) -> None:
        self._committed: CommittedRefit | None = None
        self._own = OwnState()
        self._doubles: dict[int, DoubleBuffer] = {}  # by id() of the caller's target
        self._released: Any = None  # CUDA event: readers of the spare copy are done
        self._partial = False
        self._delta = DeltaBase(self.config.rank, lambda: self._committed)
        self._seeds = PeerSeeds(self.connection)
        self._started_at = process_started_at()
        #: The peers the refit being committed was seeded from (empty: the policy's send).
        self._seeded_from: tuple[str, ...] = ()

    @property
    def committed(self) -> CommittedRefit | None:
        """The last refit received in full and verified, else None."""
        return self._committed

    @property
    def served_version(self) -> ServedVersion | None:
        """The version this rank serves: its last committed refit and the digest of that
        state's bytes (the same on every replica that serves it), for an inference server
        to tag its responses with; None before the first commit, and while an in-place
        refit that stopped part-way left the live weights a mix of two."""
        return None if self._partial else self.reporter.log.serving

    @property
    def arrived_changes(self) -> DeltaChanges | None:
        """What the refit being received changed, when it came as a delta (None: it came
        whole, or was seeded): readable from ``verify`` on, until the next receive starts.
        An engine that serves exactly its ``base_refit`` need land only its ``changed``."""
        return self._delta.arrived

    @property
    def live_weights_partial(self) -> bool:
        """Whether an in-place refit stopped part-way and no later one completed."""
        return self._partial

    def _before_connect(self) -> None:
        # Before this pod's metadata takes the rank's key: the pod it replaces may still
        # be handing over (a drain) and offer its weights.
        if self.member.generation > 0:
            self._seeds.note_predecessor()

    def _join(self, peers: PeerSet) -> None:
        self._take_place(self.connection.wait(self.store.wait_membership, "the barrier"))

    def _take_place(self, barrier: BarrierEntry) -> None:
        """Take this rollout rank's place in ``barrier`` (of its epoch or a later one: a
        new policy epoch) and connect to that epoch's policy ranks."""
        if barrier.epoch != self.member.epoch:
            self.connection.switch_epoch(barrier.epoch)
        self.connection.peers.connect(barrier)

    async def receive(
        self,
        *,
        refit_id: int | None = None,
        verify: Verifier | None = None,
        verified_as: Verification | None = None,
    ) -> RefitStats:
        """Receive the next refit into the session's own state, verify it, commit it.

        ``refit_id``: the lowest refit id to take (default: the one after the last
        committed, ``pending_refits.start``).  A rank that joined late takes the first
        refit the policy sends with an id >= that, skipping those it missed, so the
        returned ``stats.refit_id`` (and the id ``verify`` gets) may be higher.  A new
        policy epoch during the wait is joined and the refit taken from it; a scale-down
        raises :class:`~refit_worker.session.refits.Removed`, a replacement of this pod
        :class:`~refit_worker.session.refits.Superseded`.

        Double-buffered: the refit lands in a spare copy (allocated when the first refit's
        manifest arrives, the second right after that refit's commit, again when the
        layout changes; registered once); the commit makes it
        :attr:`committed` and keeps the previously committed memory as the next spare.  So
        ``committed.state`` of refit ``k`` stays valid until refit ``k + 2`` starts; copy
        out of it (or use :meth:`receive_into`) to keep it longer.

        ``verified_as`` names what ``verify`` checks (e.g. ``"bit-exact"``) for the job's
        status; without it the status claims only what the engine checked itself.  A
        ``verify`` that returns a level claims that one for this refit instead.
        """
        engine = self.connection.engine
        device = engine.common.device

        def resolve(specs: Sequence[TensorSpec]) -> Mapping[str, torch.Tensor]:
            shapes = {s.name: (s.shape, dtype_from_name(s.dtype)) for s in specs}
            return self._own.spare(shapes, device)

        delta = self._delta_target(lambda: self._own.spare(self._own.layout(), device))
        landed = await self._arrive(engine, resolve, self._first(refit_id), refit_id is None, delta)
        arrived = landed.timing.refit_id
        self._delta.landed(landed.delta)
        if verify is not None:
            # A verifier may say it reached less (or more) than was named at the start.
            verified_as = verify(arrived, dict(landed.tensors)) or verified_as
        started = time.perf_counter()
        self._commit(arrived, self._own.swap())
        stats = self._stats(landed.timing, time.perf_counter() - started, verified_as)
        # Set up the second copy now, between refits, not while the next one streams in
        # (once: from then on the two copies take turns).
        self._own.spare(self._own.layout(), device)
        return stats

    async def receive_into(
        self,
        target: Target,
        *,
        refit_id: int | None = None,
        mode: ReceiveMode = "double_buffer",
        verify: Verifier | None = None,
        verified_as: Verification | None = None,
    ) -> RefitStats:
        """Receive the next refit into ``target`` (an ``nn.Module`` or a state dict).

        ``refit_id`` and the membership as in :meth:`receive`: the first refit with an id
        >= ``refit_id`` (default: the one after the last committed) is taken.

        ``mode="double_buffer"``: into a spare copy of ``target``'s tensors, then swapped in
        (a module's parameters point at the new memory, a mapping's values are replaced);
        on any failure ``target`` is untouched.  ``mode="in_place"``: straight into
        ``target``'s tensors; pause whatever reads them first.  On a failure after the
        first byte could land this raises :class:`PartialRefitError` (a preemption:
        :class:`Preempted` with ``weights_partial=True``) and :attr:`live_weights_partial`
        turns true: do not serve those weights until a later refit completes.

        The names, dtypes and shapes of ``target`` must match what the policy sends,
        else :class:`~refit_worker.engine.LayoutMismatchError` before any byte
        lands.  ``verify(refit_id, tensors)`` runs on the filled tensors before the commit.
        """
        engine = self.connection.engine
        mode = check_mode(mode)
        if mode == "in_place":

            def in_place(specs: Sequence[TensorSpec]) -> Mapping[str, torch.Tensor]:
                return live_tensors(target, [s.name for s in specs])

            self._delta.whole()  # in place: never a delta
            landed = await self._land(engine, in_place, self._first(refit_id), partial=True)
            arrived = landed.timing.refit_id
            self._check(verify, arrived, landed.tensors, partial=True)
            started = time.perf_counter()
            self._partial = False
            self._commit(arrived, dict(landed.tensors))
            return self._stats(landed.timing, time.perf_counter() - started, verified_as)
        double = self._doubles.get(id(target))
        if double is None or double.target is not target:
            double = self._doubles[id(target)] = DoubleBuffer(target)
        # The spare was served until the last swap: CUDA kernels may still read it.
        if self._released is not None:
            self._released.synchronize()

        def spare(specs: Sequence[TensorSpec]) -> Mapping[str, torch.Tensor]:
            return double.spare([s.name for s in specs])

        delta = self._delta_target(lambda: double.spare(list(self._base_state())))
        landed = await self._arrive(engine, spare, self._first(refit_id), refit_id is None, delta)
        arrived = landed.timing.refit_id
        self._delta.landed(landed.delta)
        self._check(verify, arrived, landed.tensors, partial=False)
        started = time.perf_counter()
        self._commit(arrived, double.swap())
        return self._stats(landed.timing, time.perf_counter() - started, verified_as)

    async def _arrive(
        self,
        engine: NIXLCheckpointEngine,
        targets: Callable[[Sequence[TensorSpec]], Mapping[str, torch.Tensor]],
        min_refit: int,
        current: bool,
        delta: DeltaTarget | None = None,
    ) -> ReceivedRefit:
        """A refit into spare memory: seeded from live peers when this pod has committed
        nothing yet and a peer offers one, else the policy's send (:meth:`_land`).

        ``current``: the caller asked for "the next refit", so a seed may also be the one
        before ``min_refit``, the job's last committed (a replacement serves it at once
        instead of waiting for the trainer's next step; the next call takes ``min_refit``)."""
        self._seeded_from = ()
        if self._committed is None:
            lowest = min_refit - 1 if current and min_refit > 0 else min_refit
            seeded = await self._seed(targets, lowest)
            if seeded is not None:
                return seeded
        try:
            return await self._land(
                engine, targets, min_refit, partial=False, delta=delta, seed=True
            )
        except _PolicyDone:
            # A rank that joined as the last refit went out (a drain's replacement seeded
            # just before it): the policy ranks saw a peer stay to seed it, and left.
            log.info(
                "rollout rank %d: the policy ranks are done and refit >= %d did not reach "
                "this rank; seeding it from a rollout peer that stays",
                self.config.rank,
                min_refit,
            )
        seeded = await self._seed(targets, min_refit)
        if seeded is not None:
            return seeded
        # None only once a new policy epoch started meanwhile: its send comes.
        return await self._land(engine, targets, min_refit, partial=False, delta=delta)

    async def _seed(
        self, targets: Callable[[Sequence[TensorSpec]], Mapping[str, torch.Tensor]], lowest: int
    ) -> ReceivedRefit | None:
        seeded = await self._seeds.take(targets, lowest)
        if seeded is None:
            return None
        self._seeded_from = seeded.sources
        timing = RefitTiming(
            seeded.refit,
            "rollout",
            seeded.bytes,
            seeded.seconds,
            0.0,
            0,
            signed_by=seeded.signed_by,
            seals=seeded.seals,
        )
        return ReceivedRefit(seeded.tensors, timing)

    def _base_state(self) -> Mapping[str, torch.Tensor]:
        committed = self._committed
        return {} if committed is None else committed.state

    def _delta_target(self, spare: Callable[[], Mapping[str, torch.Tensor]]) -> DeltaTarget:
        """A delta onto the version this rank serves, applied into ``spare()``."""
        return self._delta.target(self.served_version, spare)

    def _first(self, refit_id: int | None) -> int:
        return self.reporter.log.refits_completed if refit_id is None else refit_id

    async def _land(
        self,
        engine: NIXLCheckpointEngine,
        targets: Callable[[Sequence[TensorSpec]], Mapping[str, torch.Tensor]],
        min_refit: int,
        *,
        partial: bool,
        delta: DeltaTarget | None = None,
        seed: bool = False,
    ) -> ReceivedRefit:
        """Receive the first refit >= ``min_refit`` into ``targets``, following the
        membership: a refit in flight when the policy epoch changes is abandoned and
        taken from the new epoch.  An in-place failure after landing began says so.
        ``seed``: raise :class:`_PolicyDone` once the policy ranks are done (a peer can
        seed the refit instead)."""
        who = f"rollout rank {self.config.rank}: refit >= {min_refit}"
        watch = self._still_member_or_policy_done if seed else self._still_member
        while True:
            await asyncio.to_thread(self._at_boundary)
            try:
                return await self.connection.watched(
                    engine.receive_into(targets, min_refit=min_refit, delta=delta), watch
                )
            except (LayoutMismatchError, _PolicyDone):
                raise  # refused before any byte landed, or no send will come
            except _Rejoin as exc:
                self._abandoned(engine, partial, exc)
            except Preempted as exc:
                if partial and engine.targets_exposed:
                    self._partial = True
                    raise Preempted(
                        f"{exc}; the in-place refit stopped part-way, so the live "
                        "weights are partial: do not serve them",
                        weights_partial=True,
                    ) from exc
                raise
            except Exception as exc:
                # A policy rank that died breaks the transfer before the coordinator
                # writes the next epoch: wait a while for it before calling it a failure.
                if await asyncio.to_thread(self._membership_moved):
                    self._abandoned(engine, partial, exc)
                    continue
                if partial and engine.targets_exposed:
                    self._partial = True
                    raise PartialRefitError(
                        f"{who} failed part-way ({type(exc).__name__}: {exc}); the live "
                        "weights now mix two refits: do not serve them until a later refit "
                        "completes"
                    ) from exc
                raise

    def _abandoned(self, engine: NIXLCheckpointEngine, partial: bool, why: BaseException) -> None:
        if partial and engine.targets_exposed:
            self._partial = True  # until the retried refit lands and commits
        log.warning(
            "rollout rank %d: refit in flight abandoned (%s); joining again",
            self.config.rank,
            why,
        )

    def _at_boundary(self) -> None:
        """Before a refit: act on the latest membership (a scale-down, a stale pod, a new
        policy epoch, or not listed now: wait for a place)."""
        barrier = self.store.barrier()
        if barrier is not None and barrier.epoch >= self.member.epoch:
            where = standing(barrier, self.member)
            if where == "removed":
                raise Removed(
                    f"rollout rank {self.config.rank}: removed by a scale-down to "
                    f"{barrier.rollout_world_size} rollout ranks",
                    barrier=barrier,
                )
            if where == "superseded":
                raise Superseded(
                    f"rollout rank {self.config.rank}: another pod holds this rank now "
                    f"(barrier of epoch {barrier.epoch}, version {barrier.version})"
                )
            current = where == "member" and barrier.epoch == self.member.epoch
            if current and self._policy_epoch() <= self.member.epoch:
                return
        newer = self._policy_epoch()
        if newer > self.member.epoch and (barrier is None or barrier.epoch < newer):
            # A new policy gang published but its membership is not open: it opens once
            # the running rollout ranks published for the epoch, so publish first.
            self.connection.switch_epoch(newer)
            self.connection.publish()
        try:
            joined = self.connection.wait(self.store.wait_membership, "the barrier")
        except Preempted as exc:
            latest = self.store.barrier()
            if exc.notice is None and latest is not None and self._stale(latest):
                raise Superseded(str(exc)) from exc  # says nothing under the rank's key
            raise
        self._take_place(joined)

    def _stale(self, barrier: BarrierEntry) -> bool:
        return standing(barrier, self.member) == "superseded"

    def _policy_epoch(self) -> int:
        """The latest epoch any policy rank published metadata for (-1: none)."""
        latest = -1
        for key, value in self.store.read_data().items():
            if key.startswith("meta.policy."):
                latest = max(latest, decode_entry(key, value).epoch)
        return latest

    def _membership_moved(self) -> bool:
        """Whether, within ``timeout_seconds``, the membership leaves this rank's place
        in the epoch it joined (a new epoch, a scale-down, a replacement)."""
        try:
            return poll_until(
                lambda: self._moved(self.store.barrier()),
                timeout=self.config.transfer.timeout_seconds,
                what="a change of membership that explains a failed refit",
                backoff=_MOVED_POLL,
                cancel=_Flag(self.preemption_pending),
                error=RendezvousTimeout,
            )
        except (RendezvousTimeout, WaitCancelled):
            return False

    def _moved(self, barrier: BarrierEntry | None) -> bool:
        """Whether this rank's place moved: a barrier of a later epoch, or of its own that
        no longer lists it, or a policy gang of a later epoch that published."""
        mine = self.member.epoch
        if barrier is not None and (
            barrier.epoch > mine
            or (barrier.epoch == mine and standing(barrier, self.member) != "member")
        ):
            return True
        return self._policy_epoch() > mine

    async def _still_member(self) -> None:
        await self._member_barrier()

    async def _member_barrier(self) -> BarrierEntry | None:
        """The latest barrier (None: none yet), if this rank's place did not move (else
        :class:`_Rejoin`)."""
        barrier = await asyncio.to_thread(self.store.barrier)
        if self._moved(barrier):
            raise _Rejoin("the membership moved on (a new policy epoch, or not listed now)")
        return barrier

    async def _still_member_or_policy_done(self) -> None:
        # One barrier read for both checks: this runs every second of a receive.
        barrier = await self._member_barrier()
        if barrier is None or barrier.epoch != self.member.epoch:
            return  # the policy ranks of this epoch have no barrier to be read by yet
        if await asyncio.to_thread(self._seeds.policy_gone, barrier):
            raise _PolicyDone("the policy ranks are done")

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
        self._delta.committed(refit_id)
        engine = self.connection.engine if self.connection.connected else None
        if engine is not None and engine.common.device.type == "cuda":
            # Readers queued on the old copy must finish before a refit refills it.
            self._released = torch.cuda.current_stream(engine.common.device).record_event()

    def _stats(
        self, timing: RefitTiming, commit_s: float, verified_as: Verification | None
    ) -> RefitStats:
        """The committed refit's figures, published as this rank's progress once the
        commit is offered to peers (a peer that reads the report finds the offer).  With
        no level named by a check of the caller's, the claim is what the engine checked
        of this refit (its hashes, or only the manifest): never the configuration's."""
        if verified_as is None:
            verified_as = checked_level(timing.integrity)
        stats = RefitStats(
            timing.refit_id,
            timing.bytes,
            timing.seconds + commit_s,
            timing.control_s,
            timing.registrations,
        )
        if self._committed is not None:
            committed = self._committed
            # The key whose seals this very commit passed, and those seals for the peers
            # it seeds (a commit of an earlier refit than the timing's has neither).
            own = timing.refit_id == committed.refit_id
            signed = timing.signed_by if own else None
            seals = timing.seals if own else ()
            known = timing.known_hashes if own else None
            digest = self._seeds.offer(committed.refit_id, committed.state, seals, known)
            self.reporter.log.serving = ServedVersion(
                refit=committed.refit_id, digest=digest, signed_by=signed
            )
        serving_s = time.time() - self._started_at
        if self._seeded_from:
            # Who gave the most bytes comes first; the report names it.
            source = self._seeded_from[0]
            self.reporter.seeded(
                source,
                stats.refit_id,
                nbytes=stats.bytes,
                seconds=stats.seconds,
                serving_s=serving_s,
                verification=verified_as,
            )
        else:
            self.reporter.log.first_commit(
                "policy", stats.refit_id, stats.bytes, seconds=stats.seconds, serving_s=serving_s
            )
            self.reporter.refit(stats.refit_id, stats.bytes, stats.seconds, verified_as)
        return stats

    async def linger(self) -> bool:
        """After the last refit: stay, offering it to rollout peers that join late (a
        replacement, a scale-up), until every rollout slot reported ``done``, or until
        ``timeout_seconds`` pass without a change in the membership or the ranks'
        progress.  While a rank stays (its report says ``seeding``) the policy ranks need
        not linger.  Returns whether every slot was done; False at once for a rank that
        committed nothing (nothing to offer)."""
        committed = self._committed
        if not self.connection.connected or committed is None:
            return False
        log_ = self.reporter.log
        log_.seeding = True
        self.reporter.publish("done", f"all refits done; offering refit {committed.refit_id}")
        try:
            return await self._seeds.stay(
                self._all_done,
                holds=committed.refit_id + 1,
                timeout_s=self.config.transfer.timeout_seconds,
                why="after the last refit",
            )
        finally:
            log_.seeding = False
            self.reporter.publish("done", "all refits done")

    async def hand_over(self, within: float) -> str | None:
        """This pod is stopping (a drain, an eviction): stay up to ``within`` seconds,
        offering the last committed refit, until the slot's next pod (a newer generation)
        reports serving.  Returns that pod's uid, or None (nothing committed, ``within``
        0, or no replacement served in time).  After a hand-over this pod must report
        nothing: the rank's progress key is its replacement's."""
        committed = self._committed
        if not self.connection.connected or committed is None or within <= 0:
            return None
        log.info(
            "rollout rank %d: stopping; offering refit %d to the replacement for up to %gs",
            self.config.rank,
            committed.refit_id,
            within,
        )
        found: list[str] = []

        def look() -> tuple[bool, object]:
            report = self.store.progress_all().get(("rollout", self.config.rank))
            if report is not None and successor(report, self.member):
                found.append(report.uid)
                return True, None
            return False, None

        await self._seeds.stay(
            look, holds=committed.refit_id + 1, timeout_s=within, why="handing over", absolute=True
        )
        return found[0] if found else None

    def _all_done(self) -> tuple[bool, object]:
        if self.preemption_pending():
            return True, None  # a stop request ends the stay: nothing is lost by going
        barrier = self.store.barrier(self.member.epoch)
        progress = self.store.progress_all()
        if barrier is None:
            return True, None
        saw = (
            barrier.version,
            sorted((k, p.uid, p.state, p.refits_completed) for k, p in progress.items()),
        )
        return all_done(barrier, progress), saw

    def close(self) -> None:
        """Withdraw the seed offer, then disconnect (see :meth:`RefitSession.close`)."""
        self._seeds.close()
        super().close()
