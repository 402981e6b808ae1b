""":class:`PolicySession`: a policy rank's session.  It sends each refit to the rollout
members of the moment, and after the last one serves the members that joined late.

All of it is one serve loop (:meth:`PolicySession._serve`).  Each round it looks at the
membership, asks :func:`refit_worker.policy.owed.owed` what this rank owes whom, sends that,
and lets the round's *case* say whether to go on.  There are two cases:

- :class:`_RefitRounds`, a refit's send.  Policy rank 0 plans each round's membership for
  the whole gang (:mod:`.gang`), and the gang's verdict ends the refit.  A round that
  reached no member is sent again by a new plan, on every rank at once.
- :class:`_LingerRounds`, after the last refit.  Each rank reads the membership and the
  ranks' progress itself.  It stops when every slot reported ``done``, or after
  ``timeout_seconds`` in which nothing changed.

With ``transfer.delta`` on (or auto, while deltas pay) a refit's first round sends only the
elements that changed since the last refit (:mod:`.delta_source`); a member that could not
use them declines for the whole refit, and the next round (on every rank: the gang's
verdict waits for it) sends it whole.  Lingering always sends whole.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
import torch.distributed as dist

from refit_worker.contract.adapters import AdapterHeader
from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.entries import BarrierEntry
from refit_worker.contract.roles import Role
from refit_worker.contract.waits import Backoff
from refit_worker.engine import (
    DeltaNotApplicable,
    RefitTiming,
    algorithm_for,
    is_sharded,
    local_sources,
)
from refit_worker.policy.adapter_refit import adapter_items
from refit_worker.policy.delta_source import DeltaSource, Offer
from refit_worker.policy.gang_plan import PolicyGang, join_policy_group
from refit_worker.policy.owed import (
    Owed,
    RankMapping,
    all_have,
    not_serving,
    owed,
    seeding_peer,
)
from refit_worker.rendezvous import Preempted, RendezvousStore
from refit_worker.session.following import PeerSet
from refit_worker.session.refit_session import RefitSession
from refit_worker.session.refits import RefitStats, RefitUndelivered
from refit_worker.session.rollout_reports import Progress, all_done

log = logging.getLogger(__name__)

#: How long a serve round that reached no one waits before the next (a lingering rank
#: re-reads the membership and the ranks' progress this often).
ROUND_INTERVAL_S = 0.5

Items = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class Look:
    """What one round serves by: the membership, and the progress reports (None: not read,
    every listed member is owed the refit)."""

    barrier: BarrierEntry
    progress: Progress | None


@dataclass(slots=True)
class Served:
    """What the serve loop did for one refit."""

    refit: int
    #: (rank, pod uid) of the members that confirmed the refit to this rank.
    confirmed: set[tuple[int, str]] = field(default_factory=set)
    sends: int = 0
    #: The last round's send (an empty one where the round owed no one).
    timing: RefitTiming | None = None


class _Rounds(Protocol):
    """One case of the serve loop: what a round looks at, and whether the loop ends."""

    async def look(self) -> Look | None:
        """The round's membership and progress; None: nothing is owed any more."""

    async def ended(self, look: Look, due: dict[int, Owed], timing: RefitTiming) -> bool:
        """After the round's send: whether the loop ends (raise to give the refit up)."""


class PolicySession(RefitSession):
    """Sending refits (policy ranks); see the module docstring."""

    role: ClassVar[Role] = "policy"

    def __init__(
        self,
        config: WorkerConfig,
        *,
        store: RendezvousStore | None = None,
        stop_requested: Callable[[], bool] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(config, store=store, stop_requested=stop_requested)
        #: The policy ranks' group (None: the default one), where rank 0 hands out each
        #: refit's membership (:mod:`refit_worker.policy.gang_plan`).
        self._group = group
        self._gang: PolicyGang | None = None
        #: The last refit this rank sent, and who confirmed it.
        self._last: Served | None = None
        #: ``transfer.delta`` on or auto: the weights as last sent (None: every refit whole).
        delta = config.transfer.delta
        self._deltas = None if delta is None or delta == "off" else DeltaSource(config.rank, delta)

    def _before_connect(self) -> None:
        cfg = self.config
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

    def _join(self, peers: PeerSet) -> None:
        # The members may come later (or go): each refit's plan reads them again.
        peers.connect(self.connection.wait(self.store.wait_barrier, "the barrier"))

    @property
    def gang(self) -> PolicyGang:
        if self._gang is None:
            raise RuntimeError("RefitSession is not connected: call connect() first")
        return self._gang

    async def send(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        refit_id: int,
        adapter: AdapterHeader | None = None,
    ) -> RefitStats:
        """Stream ``weights`` (e.g. ``model.named_parameters()``) as refit ``refit_id``.

        To the rollout members of one membership for the whole policy gang: policy rank 0
        reads the latest barrier of this epoch just before (at least one member is waited
        for, up to ``timeout_seconds``) and hands it to the other ranks, so every rank
        maps the refit by the same R and stamps the same version (:mod:`.gang`).  A member
        lost during the send (gone from a newer barrier, a NIXL error, a timeout, a
        decline) is dropped from it and the others get it; a refit that reached no member
        of any rank is sent again by a new plan, to the members that still lack it, on
        every rank at once (:class:`~refit_worker.session.refits.RefitUndelivered` after
        ``timeout_seconds`` without one).  ``stats.delivered`` names who confirmed to this
        rank.

        DTensor weights (FSDP2, tensor parallel) are sent shard by shard: this rank writes
        only its own blocks (no ``full_tensor()``, no collective over the weights: the plan's
        two small ones only), and the stats count only those bytes; see docs/trainers.md.

        ``adapter``: ``weights`` are a PEFT LoRA adapter's state
        (``get_peft_model_state_dict``), sent with this header (rank, alpha, targets, the
        base's identity and digest) as an adapter refit; see docs/adapters.md.
        """
        items = [(name, tensor.detach()) for name, tensor in weights]
        if adapter is not None:
            items = adapter_items(items, adapter)
        mapping = self._mapping(items)
        rounds = _RefitRounds(self, refit_id, mapping)
        offer = await self._offer(items, refit_id, mapping)
        served = await self._serve(items, mapping, Served(refit_id), rounds, offer)
        self._last = served
        if self._deltas is not None and offer is not None:
            self._deltas.sent(refit_id, items, offer)
        timing = served.timing
        if timing is None:  # the refit rounds end only after a round's send
            raise RuntimeError(f"refit {refit_id}: the serve loop ended without a send")
        self.reporter.refit(refit_id, timing.bytes, timing.seconds, None)
        return RefitStats(
            refit_id,
            timing.bytes,
            timing.seconds,
            timing.control_s,
            timing.registrations,
            frozenset(timing.delivered),
            tuple(sorted(timing.dropped.items())),
        )

    async def linger(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """After the last refit: send it again to members that have not committed it.

        ``weights`` are the last refit's.  A member that joined after the last refit (a
        replacement, a scale-up) gets it this way.  Returns when every rollout slot of
        the latest barrier reported ``done``, when a rollout member stays to seed late
        peers with the last refit (:meth:`RolloutSession.linger`), or when
        ``timeout_seconds`` passed without a change in the membership or the ranks'
        progress; returns how many sends it made.
        """
        last = self.config.transfer.refits - 1
        if self._last is None or self._last.refit != last:
            return 0  # this rank did not send the last refit: nothing of its own to offer
        items = [(name, tensor.detach()) for name, tensor in weights]
        before = self._last.sends
        rounds = _LingerRounds(self, last)
        # Said in the report: a late member waits for this rank's send only while it stays.
        self.reporter.log.seeding = True
        self.reporter.publish("done", "all refits sent; serving late members")
        try:
            self._last = await self._serve(items, self._mapping(items), self._last, rounds)
        finally:
            self.reporter.log.seeding = False
            self.reporter.publish("done", "all refits done")
        return self._last.sends - before

    @property
    def last_sent(self) -> int | None:
        """The last refit this rank sent (None: none yet in this epoch)."""
        return None if self._last is None else self._last.refit

    async def await_rollouts(self, refit: int) -> bool:
        """Wait until every rollout slot of the latest barrier serves ``refit`` (or a later
        one), as a synchronous, on-policy trainer does before its next step: a replacement
        is seeded or sent the refit first, so the next one reaches it as a delta, not late.

        Bounded by ``timeout_seconds`` (False, with a warning naming the slots: the caller
        trains on) and cut short by a preemption (False)."""
        timeout = self.config.transfer.timeout_seconds
        deadline = time.monotonic() + timeout
        waiting: list[int] = []
        # Short sleeps first: the replicas usually report the commit just after the send.
        delays = Backoff(first=0.05, cap=ROUND_INTERVAL_S).delays()
        while not self.preemption_pending():
            barrier = await asyncio.to_thread(self.store.barrier, self.member.epoch)
            if barrier is not None:
                progress = await asyncio.to_thread(self.store.progress_all)
                waiting = not_serving(barrier, progress, refit)
                if not waiting:
                    return True
            if time.monotonic() >= deadline:
                log.warning(
                    "policy rank %d: rollout slots %s do not serve refit %d after %gs; "
                    "training on without them (weights.synthetic.lockstep)",
                    self.config.rank,
                    waiting,
                    refit,
                    timeout,
                )
                return False
            await asyncio.sleep(next(delays))
        return False

    # -- the serve loop ------------------------------------------------------------------

    async def _offer(self, items: Items, refit: int, mapping: RankMapping) -> Offer | None:
        """The first round's payload with ``transfer.delta`` on or auto (None: off).  DTensor
        weights: every policy rank offers the changes of its own blocks and the gang agrees
        on one delta, or on a whole refit (a collective over the policy group: every rank
        takes this step for every refit)."""
        deltas = self._deltas
        if deltas is None:
            return None
        if not mapping.sharded:
            return deltas.offer(items, refit)
        device = self.connection.engine.common.device
        local = local_sources(
            items, rank=self.config.rank, world_size=self.config.policy_world_size, device=device
        )
        return await asyncio.to_thread(
            deltas.offer_sharded, local, refit, self.gang.exchange, algorithm_for(device)
        )

    def _mapping(self, items: Items) -> RankMapping:
        engine = self.connection.engine
        return RankMapping(
            self.config.rank, self.config.policy_world_size, engine.common.stripe, is_sharded(items)
        )

    async def _serve(
        self,
        items: Items,
        mapping: RankMapping,
        served: Served,
        rounds: _Rounds,
        offer: Offer | None = None,
    ) -> Served:
        """Serve ``served.refit`` round by round until ``rounds`` says it ended: each round
        sends what :func:`~refit_worker.policy.owed.owed` names (by ``mapping``), to those
        members only.  ``offer``: the first round's delta, if any; later rounds are whole."""
        first = offer if offer is not None and offer.header is not None else None
        while True:
            look = await rounds.look()
            if look is None:
                return served
            due = owed(
                look.barrier,
                look.progress,
                refit=served.refit,
                confirmed=served.confirmed,
                mapping=mapping,
            )
            timing = await self._send_round(items, served.refit, look, due, first)
            first = None
            if timing is None:  # nothing to send to this round
                timing = RefitTiming(served.refit, "policy", 0, 0.0, 0.0, 0)
            else:
                served.sends += 1
                served.confirmed |= self.connection.peers.confirmed(timing.delivered)
            served.timing = timing
            if await rounds.ended(look, due, timing):
                return served
            if not (timing.delivered or timing.wants_whole):  # reached no one: give them time
                await asyncio.sleep(ROUND_INTERVAL_S)

    async def _send_round(
        self,
        items: Items,
        refit: int,
        look: Look,
        due: dict[int, Owed],
        delta: Offer | None = None,
    ) -> RefitTiming | None:
        """One send of ``refit`` to ``due``; None when there is no one to send to (nothing
        due, or listed members whose metadata is not readable yet).  A round that owes
        every listed member (its progress unread) keeps the engine's peers as they are, so
        the prepared WRITEs of the members that stayed are reused."""
        if not due:
            return None
        peers = self.connection.peers
        only = None if look.progress is None else set(due)
        if only is not None:  # a round after a refit's first: to the members that lack it
            log.info(
                "policy rank %d: sending refit %d again to %s", self.config.rank, refit, sorted(due)
            )
        if peers.only != only or look.barrier != peers.barrier:
            peers.connect(look.barrier, only=only)
        if not peers.targets:
            return None
        engine = self.connection.engine
        if delta is not None and delta.header is not None:  # the first round's delta
            try:
                return await self.connection.watched(
                    engine.send_weights(
                        iter(delta.items), refit_id=refit, delta=delta.header, pieces=delta.pieces
                    ),
                    self._drop_gone,
                )
            except DeltaNotApplicable as exc:  # raised before anything was sent
                log.warning("policy rank %d: %s; sending whole from now on", self.config.rank, exc)
                if delta.pieces is None:
                    self._deltas = None
                elif self._deltas is not None:  # the gang still exchanges offers each refit
                    self._deltas.refuse(str(exc))
        return await self.connection.watched(
            engine.send_weights(iter(items), refit_id=refit), self._drop_gone
        )

    async def _drop_gone(self) -> None:
        newer = await asyncio.to_thread(self.store.barrier, self.member.epoch)
        if newer is not None:
            self.connection.peers.drop_gone(newer)


class _RefitRounds:
    """A refit's send: the gang plans each round and its verdict ends it."""

    def __init__(self, session: PolicySession, refit: int, mapping: RankMapping) -> None:
        self.session, self.refit, self.mapping = session, refit, mapping
        self.timeout = session.config.transfer.timeout_seconds
        self.deadline = time.monotonic() + self.timeout
        self.first = True

    async def look(self) -> Look:
        conn = self.session.connection
        barrier = await asyncio.to_thread(
            self.session.gang.plan,
            self.refit,
            lambda: conn.wait(conn.peers.wait_members, "a rollout member"),
        )
        # The first round owes every member; a later one reads who still lacks the refit.
        progress = None if self.first else await asyncio.to_thread(conn.store.progress_all)
        self.first = False
        return Look(barrier, progress)

    async def ended(self, look: Look, due: dict[int, Owed], timing: RefitTiming) -> bool:
        settled = bool(timing.delivered)
        # A member that declined the delta still wants this refit: the gang sends again.
        resend = bool(timing.wants_whole)
        if not settled:
            # Each member this rank sends to declined because it already committed this
            # refit or a later one (from another source): nothing is owed any more.
            mine = owed(look.barrier, None, refit=self.refit, confirmed=set(), mapping=self.mapping)
            if mine:
                progress = await asyncio.to_thread(self.session.store.progress_all)
                settled = all_have(mine, progress)
        verdict = await asyncio.to_thread(
            self.session.gang.verdict,
            settled=settled,
            past=time.monotonic() >= self.deadline,
            resend=resend,
        )
        if verdict.settled:
            return True
        rank = self.session.config.rank
        if verdict.past:
            raise RefitUndelivered(
                f"policy rank {rank}: refit {self.refit} reached no rollout "
                f"member within {self.timeout:g}s (dropped: {dict(timing.dropped)})"
            )
        if resend or timing.delivered:  # another rank's members want it whole
            log.info(
                "policy rank %d: refit %d goes again, whole, to the members that could not "
                "use the delta (rollout ranks %s here)",
                rank,
                self.refit,
                sorted(timing.wants_whole),
            )
            return False
        log.warning(
            "policy rank %d: refit %d reached no member (dropped: %s); sending it again",
            rank,
            self.refit,
            dict(timing.dropped),
        )
        return False


class _LingerRounds:
    """After the last refit: each rank on its own, until every slot is done or nothing
    changed for ``timeout_seconds``."""

    def __init__(self, session: PolicySession, refit: int) -> None:
        self.session, self.refit = session, refit
        self.timeout = session.config.transfer.timeout_seconds
        self.seen: object = None
        self.changed_at = time.monotonic()

    async def look(self) -> Look | None:
        session = self.session
        if session.preemption_pending():
            raise Preempted(f"policy rank {session.config.rank}: preempted while lingering")
        barrier = await asyncio.to_thread(session.store.barrier, session.member.epoch)
        progress = await asyncio.to_thread(session.store.progress_all)
        if barrier is None or all_done(barrier, progress):
            return None
        seeder = seeding_peer(barrier, progress, self.refit)
        if seeder is not None:
            log.info(
                "policy rank %d: rollout-%d stays to seed late members with refit %d; "
                "stopping lingering",
                session.config.rank,
                seeder,
                self.refit,
            )
            return None
        return Look(barrier, progress)

    async def ended(self, look: Look, due: dict[int, Owed], timing: RefitTiming) -> bool:
        progress = look.progress or {}  # a lingering round always reads it
        now = (
            look.barrier.version,
            sorted(due),
            sorted((k, p.state, p.refits_completed) for k, p in progress.items()),
        )
        if now != self.seen or timing.delivered:
            self.seen, self.changed_at = now, time.monotonic()
            return False
        if time.monotonic() - self.changed_at <= self.timeout:
            return False
        log.warning(
            "policy rank %d: stopped lingering after %gs without a change; "
            "members still without refit %d: %s",
            self.session.config.rank,
            self.timeout,
            self.refit,
            sorted(due),
        )
        return True
