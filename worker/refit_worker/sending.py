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
from refit_worker.checkpoint_engines.membership import targets_for_policy
from refit_worker.checkpoint_engines.shards import is_sharded
from refit_worker.membership import all_done, all_have, lacking, remapped
from refit_worker.refits import (
    RefitStats,
    RefitUndelivered,
)
from refit_worker.rendezvous import (
    Preempted,
)
from refit_worker.session_base import LINGER_INTERVAL_S, SessionBase

log = logging.getLogger(__name__)

#: After a declined send by a new mapping, before the next look at the progress reports.
_REMAP_RETRY_S = 0.1


class PolicySide(SessionBase):
    """Sending refits (policy ranks)."""

    async def send(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, refit_id: int
    ) -> RefitStats:
        """Stream ``weights`` (e.g. ``model.named_parameters()``) as refit ``refit_id``.

        To the rollout members of the latest barrier of this epoch, read just before (at
        least one is waited for, up to ``timeout_seconds``).  A member lost during the
        send (gone from a newer barrier, a NIXL error, a timeout, a decline) is dropped
        from it and the others get it; a refit that reached no member is sent again once
        one is there (:class:`~refit_worker.refits.RefitUndelivered` after
        ``timeout_seconds`` without one).  ``stats.delivered`` names who confirmed.

        DTensor weights (FSDP2, tensor parallel) are sent shard by shard: this rank writes
        only its own blocks (no ``full_tensor()``, no collective on the trainer's group), and
        the stats count only those bytes; see docs/trainers.md.
        """
        engine = self._require("policy")
        items = [(name, tensor.detach()) for name, tensor in weights]
        timing = await self._send_to_members(engine, items, refit_id, only=None)
        sends = [timing, *await self._serve_remapped(engine, items, refit_id)]
        moved, seconds = sum(t.bytes for t in sends), sum(t.seconds for t in sends)
        delivered = frozenset(r for t in sends for r in t.delivered)
        dropped = {r: why for t in sends for r, why in t.dropped.items() if r not in delivered}
        self.reporter.refit(refit_id, moved, seconds, None)
        return RefitStats(
            refit_id,
            moved,
            seconds,
            sum(t.control_s for t in sends),
            sum(t.registrations for t in sends),
            delivered,
            tuple(sorted(dropped.items())),
        )

    async def _send_to_members(
        self,
        engine: NIXLCheckpointEngine,
        items: list[tuple[str, torch.Tensor]],
        refit_id: int,
        *,
        only: set[int] | None,
    ) -> RefitTiming:
        """Send until at least one member confirmed, within ``timeout_seconds``."""
        peers, timeout = self._require_peers(), self.config.transfer.timeout_seconds
        deadline = time.monotonic() + timeout
        while True:
            barrier = await asyncio.to_thread(self._wait, peers.wait_members, "a rollout member")
            if only is not None or peers.only is not None or barrier != peers.barrier:
                peers.connect(barrier, only=only)
            if not peers.targets:  # listed, but its metadata not readable yet, or not owed
                if time.monotonic() >= deadline:
                    raise RefitUndelivered(
                        f"policy rank {self.config.rank}: refit {refit_id}: no rollout member "
                        f"to send to within {timeout:g}s"
                    )
                await asyncio.sleep(LINGER_INTERVAL_S)
                continue
            timing = await self._watched(
                engine.send_weights(iter(items), refit_id=refit_id), self._drop_gone
            )
            if timing.delivered:
                self._last_sent = (refit_id, peers.confirmed(timing.delivered))
                return timing
            progress = await asyncio.to_thread(self.store.progress_all)
            if all_have(peers.targets, progress, refit_id):
                # Each target declined because it already committed this refit or a later
                # one (from another source): nothing is owed, so nothing is sent again.
                log.info(
                    "policy rank %d: refit %d: every member it maps to already has it",
                    self.config.rank,
                    refit_id,
                )
                self._last_sent = (refit_id, set())
                return timing
            if time.monotonic() >= deadline:
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

    async def _serve_remapped(
        self, engine: NIXLCheckpointEngine, items: list[tuple[str, torch.Tensor]], refit_id: int
    ) -> list[RefitTiming]:
        """After a send: also serve the members that a membership written during it maps
        to this rank and the send's plan did not.

        Policy ranks read the membership a moment apart, so across a change of R (a scale
        from 3 rollout ranks to 1 with 2 policy ranks) one may plan a refit by the old
        mapping and the other by the new one, whose receivers wait for both shares.  The
        rank that planned by the old one must not go on to its next step (where it may
        wait on the other in a collective) while its share is owed.  Bounded by
        ``timeout_seconds``; a member still without it then gets the next refit."""
        peers = self._require_peers()
        planned, timeout = peers.barrier, self.config.transfer.timeout_seconds
        if self.config.policy_world_size < 2 or planned is None or self._last_sent is None:
            return []  # one policy rank: the mapping sends it every member, whatever R is
        deadline, sends = time.monotonic() + timeout, []
        while not self.preemption_pending():  # the caller's refit boundary stops for it
            newer = await asyncio.to_thread(self.store.barrier, self.member.epoch)
            if newer is None or newer.rollout_world_size == planned.rollout_world_size:
                break  # the usual case: R did not change since the plan (see remapped())
            progress = await asyncio.to_thread(self.store.progress_all)
            confirmed = self._last_sent[1]
            owed = set(
                targets_for_policy(
                    self.config.rank,
                    train_world_size=self.config.policy_world_size,
                    rollout_world_size=newer.rollout_world_size,
                    members=remapped(planned, newer, progress, refit_id, confirmed),
                    stripe=engine.stripe,
                    sharded=is_sharded(items),
                )
            )
            if not owed:
                break
            if time.monotonic() >= deadline:
                log.warning(
                    "policy rank %d: refit %d: members %s still lack it %gs after the "
                    "membership changed (version %d -> %d); they get the next refit",
                    self.config.rank,
                    refit_id,
                    sorted(owed),
                    timeout,
                    planned.version,
                    newer.version,
                )
                break
            log.info(
                "policy rank %d: refit %d: the membership changed during the send "
                "(version %d -> %d); sending it to %s by the new one",
                self.config.rank,
                refit_id,
                planned.version,
                newer.version,
                sorted(owed),
            )
            peers.connect(newer, only=owed)
            if peers.targets:
                timing = await self._watched(
                    engine.send_weights(iter(items), refit_id=refit_id), self._drop_gone
                )
                sends.append(timing)
                took = peers.confirmed(timing.delivered)
                self._last_sent = (refit_id, confirmed | took)
                if took:
                    continue
            # Declined: it had the refit by now (the next read tells), or the other
            # share was not there yet (that receiver waited for it before declining).
            await asyncio.sleep(_REMAP_RETRY_S)
        return sends

    async def _drop_gone(self) -> None:
        newer = await asyncio.to_thread(self.store.barrier, self.member.epoch)
        if newer is not None:
            self._require_peers().drop_gone(newer)

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
            owed = {
                rank
                for rank in lacking(barrier, progress, refits)
                if (rank, barrier.rollout[rank].uid) not in confirmed  # type: ignore[union-attr]
            }
            # Only members this rank sends to by the mapping are its to serve; another
            # policy rank owes the rest.
            owed = set(
                targets_for_policy(
                    self.config.rank,
                    train_world_size=self.config.policy_world_size,
                    rollout_world_size=barrier.rollout_world_size,
                    members=owed,
                    stripe=engine.stripe,
                    sharded=sharded,
                )
            )
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
            log.info(
                "policy rank %d: sending refit %d again to %s",
                self.config.rank,
                refits - 1,
                sorted(owed),
            )
            sends += 1
            try:
                await self._send_to_members(engine, items, refits - 1, only=owed)
            except RefitUndelivered as exc:
                log.warning("%s", exc)  # a send that reaches no one is no change
                continue
            confirmed |= self._last_sent[1]
            self._last_sent = (refits - 1, confirmed)
            changed_at = time.monotonic()
