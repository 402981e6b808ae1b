"""The policy rank's side of :class:`~refit_worker.session.RefitSession`: sending each
refit to the rollout members of the moment, and lingering after the last one for members
that joined late.

Must not import: the operator, kubernetes (the store does that lazily).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

import torch

from refit_worker.checkpoint_engines import (
    NIXLCheckpointEngine,
    RefitTiming,
)
from refit_worker.checkpoint_engines.peers import targets_for_policy
from refit_worker.checkpoint_engines.shards import is_sharded
from refit_worker.contract.entries import BarrierEntry
from refit_worker.following import Progress, all_done, all_have, lacking
from refit_worker.refits import (
    RefitStats,
    RefitUndelivered,
)
from refit_worker.rendezvous import (
    Preempted,
)
from refit_worker.session_base import LINGER_INTERVAL_S, SessionBase

log = logging.getLogger(__name__)


class PolicySide(SessionBase):
    """Sending refits (policy ranks)."""

    async def send(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, refit_id: int
    ) -> RefitStats:
        """Stream ``weights`` (e.g. ``model.named_parameters()``) as refit ``refit_id``.

        To the rollout members of one membership for the whole policy gang: policy rank 0
        reads the latest barrier of this epoch just before (at least one member is waited
        for, up to ``timeout_seconds``) and hands it to the other ranks, so every rank
        maps the refit by the same R and stamps the same version (:mod:`.gang`).  A member
        lost during the send (gone from a newer barrier, a NIXL error, a timeout, a
        decline) is dropped from it and the others get it; a refit that reached no member
        of any rank is sent again by a new plan, on every rank at once
        (:class:`~refit_worker.refits.RefitUndelivered` after ``timeout_seconds`` without
        one).  ``stats.delivered`` names who confirmed to this rank.

        DTensor weights (FSDP2, tensor parallel) are sent shard by shard: this rank writes
        only its own blocks (no ``full_tensor()``, no collective over the weights: the plan's
        two small ones only), and the stats count only those bytes; see docs/trainers.md.
        """
        engine = self._require("policy")
        items = [(name, tensor.detach()) for name, tensor in weights]
        timing = await self._send_by_plan(engine, items, refit_id)
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

    async def _send_by_plan(
        self, engine: NIXLCheckpointEngine, items: list[tuple[str, torch.Tensor]], refit_id: int
    ) -> RefitTiming:
        """Send by the gang's plan until the gang's verdict says some member has the
        refit, within ``timeout_seconds``; every rank takes each turn of this loop."""
        peers, gang = self._require_peers(), self._require_gang()
        timeout = self.config.transfer.timeout_seconds
        deadline = time.monotonic() + timeout
        while True:
            barrier = await asyncio.to_thread(
                gang.plan, refit_id, lambda: self._wait(peers.wait_members, "a rollout member")
            )
            if peers.only is not None or barrier != peers.barrier:
                peers.connect(barrier)
            timing = await self._send_once(engine, items, refit_id)
            settled = bool(timing.delivered)
            if not settled and peers.targets:
                progress = await asyncio.to_thread(self.store.progress_all)
                # Each target declined because it already committed this refit or a later
                # one (from another source): nothing is owed, so nothing is sent again.
                settled = all_have(peers.targets, progress, refit_id)
            verdict = await asyncio.to_thread(
                gang.verdict, settled=settled, past=time.monotonic() >= deadline
            )
            if verdict.settled:
                self._last_sent = (refit_id, peers.confirmed(timing.delivered))
                return timing
            if verdict.past:
                raise RefitUndelivered(
                    f"policy rank {self.config.rank}: refit {refit_id} reached no rollout "
                    f"member within {timeout:g}s (dropped: {dict(timing.dropped)})"
                )
            log.warning(
                "policy rank %d: refit %d reached no member (dropped: %s); sending it again",
                self.config.rank,
                refit_id,
                dict(timing.dropped),
            )
            await asyncio.sleep(LINGER_INTERVAL_S)

    async def _send_once(
        self, engine: NIXLCheckpointEngine, items: list[tuple[str, torch.Tensor]], refit_id: int
    ) -> RefitTiming:
        """One send to the engine's targets of the moment (none: listed members whose
        metadata is not readable yet, or none this rank maps to: an empty timing)."""
        if not self._require_peers().targets:
            return RefitTiming(refit_id, "policy", 0, 0.0, 0.0, 0)
        return await self._watched(
            engine.send_weights(iter(items), refit_id=refit_id), self._drop_gone
        )

    async def _drop_gone(self) -> None:
        newer = await asyncio.to_thread(self.store.barrier, self.member.epoch)
        if newer is not None:
            self._require_peers().drop_gone(newer)

    def _owed(
        self,
        engine: NIXLCheckpointEngine,
        barrier: BarrierEntry,
        progress: Progress,
        confirmed: set[tuple[int, str]],
        *,
        sharded: bool,
    ) -> set[int]:
        """The members lacking the last refit that this rank serves by the mapping (another
        policy rank owes the rest) and that did not confirm it to this rank."""
        refits = self.config.transfer.refits
        owed = {
            rank
            for rank in lacking(barrier, progress, refits)
            if (rank, barrier.rollout[rank].uid) not in confirmed  # type: ignore[union-attr]
        }
        return set(
            targets_for_policy(
                self.config.rank,
                train_world_size=self.config.policy_world_size,
                rollout_world_size=barrier.rollout_world_size,
                members=owed,
                stripe=engine.stripe,
                sharded=sharded,
            )
        )

    async def linger(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """After the last refit: send it again to members that have not committed it.

        ``weights`` are the last refit's.  A member that joined after the last refit (a
        replacement, a scale-up) gets it this way.  Returns when every rollout slot of
        the latest barrier reported ``done``, or when ``timeout_seconds`` passed without
        a change in the membership or the ranks' progress; returns how many sends it made.
        """
        refits = self.config.transfer.refits
        if self._last_sent is None or self._last_sent[0] != refits - 1:
            return 0  # this rank did not send the last refit: nothing of its own to offer
        engine = self._require("policy")
        items = [(name, tensor.detach()) for name, tensor in weights]
        timeout, sends = self.config.transfer.timeout_seconds, 0
        sharded = is_sharded(items)
        seen: object = None
        changed_at = time.monotonic()
        while True:
            if self.preemption_pending():
                raise Preempted(f"policy rank {self.config.rank}: preempted while lingering")
            barrier = await asyncio.to_thread(self.store.barrier, self.member.epoch)
            progress = await asyncio.to_thread(self.store.progress_all)
            if barrier is None or all_done(barrier, progress):
                return sends
            confirmed = self._last_sent[1]
            owed = self._owed(engine, barrier, progress, confirmed, sharded=sharded)
            now = (
                barrier.version,
                sorted(owed),
                sorted((k, p.state, p.refits_completed) for k, p in progress.items()),
            )
            if now != seen:
                seen, changed_at = now, time.monotonic()
            elif time.monotonic() - changed_at > timeout:
                log.warning(
                    "policy rank %d: stopped lingering after %gs without a change; "
                    "members still without refit %d: %s",
                    self.config.rank,
                    timeout,
                    refits - 1,
                    sorted(owed),
                )
                return sends
            if not owed:
                await asyncio.sleep(LINGER_INTERVAL_S)
                continue
            last, me = refits - 1, self.config.rank
            log.info("policy rank %d: sending refit %d again to %s", me, last, sorted(owed))
            sends += 1
            peers = self._require_peers()
            peers.connect(barrier, only=owed)
            timing = await self._send_once(engine, items, last)
            confirmed |= peers.confirmed(timing.delivered)
            self._last_sent = (last, confirmed)
            if timing.delivered:
                changed_at = time.monotonic()
            else:  # a send that reaches no one is no change: the next round looks again
                await asyncio.sleep(LINGER_INTERVAL_S)
