""":class:`PeerSeeds`: a rollout session's part in peer seeding (issue #31).

After every commit the rank offers what it committed
(:class:`~refit_worker.engine.rollout.seed_transfer.SeedOffer`: rewritten in place, the pointer
published with the rank's metadata the first time and whenever it moves).  A rank that
has committed nothing yet tries, before it waits for the policy's send, to seed the last
committed refit from live rollout peers (:func:`~refit_worker.engine.rollout.seed_transfer.pull`,
striped over the peers that agree, every tensor verified); when no peer qualifies or the
seed fails, it takes the policy's send as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

from refit_worker.contract.entries import BarrierEntry, SeedPointer
from refit_worker.engine import (
    KnownHash,
    SealRecord,
    Seeded,
    SeedError,
    SeedOffer,
    SeedSource,
    TargetResolver,
    pointer_metadata,
    pull,
)
from refit_worker.rollout.seed_choice import policy_done, predecessor, seed_sources
from refit_worker.session.connection import Connection

log = logging.getLogger(__name__)

#: Tries at a seed before the policy's send is taken: a try fails when a peer moved on to
#: a newer refit while it was read, and the next try reads the newer one.
SEED_TRIES = 3
#: The longest one try waits for a peer's READs: a seed should take a fraction of a
#: refit's time, and a slow peer must not hold up the policy's send for the whole timeout.
SEED_TIMEOUT_S = 30.0
#: While a rank stays to seed: how often it moves NIXL along (over UCX's TCP transport a
#: peer's READ of this rank's memory progresses only when this rank polls its worker) ...
PROGRESS_INTERVAL_S = 0.002
#: ... and how often it re-reads the membership and progress (a ConfigMap GET each time).
LOOK_INTERVAL_S = 0.5

#: What a staying rank looks at each time: whether to stop, and what it saw (a change
#: of it restarts the timeout).
Look = Callable[[], tuple[bool, Hashable]]


class PeerSeeds:
    """Offer this rank's commits to peers, and seed its first one from them."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._offer: SeedOffer | None = None
        #: The pod this one replaces, if it offered a seed and may still be handing over
        #: (a drain): (its committed refits, where it offers); read before this pod's own
        #: metadata takes the rank's key.
        self._predecessor: tuple[int, SeedSource] | None = None

    def note_predecessor(self) -> None:
        """Remember the offer of the pod this one replaces (see ``_predecessor``)."""
        member, store = self.connection.member, self.connection.store
        data = store.read_data()
        found = predecessor(data, member.rank, member.uid, member.generation)
        if found is not None:
            log.info(
                "rollout rank %d: the pod it replaces (generation < %d) offered refit %d; "
                "it may still hand over",
                self.rank,
                member.generation,
                found[0] - 1,
            )
        self._predecessor = found

    @property
    def rank(self) -> int:
        return self.connection.config.rank

    def offer(
        self,
        refit: int,
        committed: Mapping[str, torch.Tensor],
        seals: Sequence[SealRecord] = (),
        known: Mapping[str, KnownHash] | None = None,
    ) -> str | None:
        """Offer refit ``refit`` (the committed tensors); best effort: a rank that cannot
        offer still serves, its peers then take the policy's send.  Returns the committed
        state's digest (None: the offer failed before its tensors were hashed)."""
        if not self.connection.connected:
            return None
        engine = self.connection.engine
        try:
            if self._offer is None:
                self._offer = SeedOffer(
                    engine.common.agent, engine.common.registry, engine.common.device
                )
            moved = self._offer.publish(refit, committed, seals, known)
            if moved and self._offer.pointer is not None:
                (addr, nbytes, dev_id), metadata = self._offer.pointer
                self.connection.seed = SeedPointer(
                    addr=addr, nbytes=nbytes, dev_id=dev_id, metadata=pointer_metadata(metadata)
                )
                self.connection.publish()
        except Exception as exc:
            log.warning(
                "rollout rank %d: cannot offer refit %d to peers: %s", self.rank, refit, exc
            )
        return self._offer.digest if self._offer is not None else None

    async def take(self, resolve: TargetResolver, min_refit: int) -> Seeded | None:
        """Seed refit >= ``min_refit`` from live peers into ``resolve(specs)``; None when
        none qualifies or every try failed (the caller takes the policy's send).  Once
        the policy ranks are done (they left late members to the peers that stay) there
        is no send to take: it keeps looking for a peer, and after ``timeout_seconds``
        raises :class:`SeedError` saying so."""
        timeout = self.connection.config.transfer.timeout_seconds
        deadline = time.monotonic() + timeout
        attempt = 0
        while True:
            attempt += 1
            sources, policy_done = await asyncio.to_thread(self._look, min_refit)
            if sources:
                seeded = await self._try(sources, resolve, min_refit, attempt)
                if seeded is not None:
                    return seeded
            if not policy_done and (not sources or attempt >= SEED_TRIES):
                if not sources and attempt == 1:
                    log.info(
                        "rollout rank %d: no live peer offers refit >= %d; taking the "
                        "policy's send",
                        self.rank,
                        min_refit,
                    )
                return None
            if time.monotonic() >= deadline:
                raise SeedError(
                    f"rollout rank {self.rank}: the policy ranks are done and no rollout "
                    f"peer seeded refit >= {min_refit} within {timeout:g}s"
                )
            await asyncio.sleep(LOOK_INTERVAL_S)

    def policy_gone(self, barrier: BarrierEntry) -> bool:
        """Whether the policy ranks of ``barrier`` (this rank's epoch) are done and left
        late members to the rollout peers that stay: no send will come any more."""
        progress = self.connection.store.progress_all()
        return policy_done(barrier, progress, self.connection.config.transfer.refits)

    def _look(self, min_refit: int) -> tuple[list[SeedSource], bool]:
        """The peers to seed from, and whether the policy ranks are all done."""
        store, member = self.connection.store, self.connection.member
        barrier = store.barrier(member.epoch)
        if barrier is None:
            return [], False
        progress = store.progress_all()
        sources = seed_sources(
            barrier,
            store.snapshot(barrier.epoch).meta,
            progress,
            me=self.rank,
            min_refit=min_refit,
            layout=self.connection.published_layout,
        )
        # Live members first; the pod this one replaces last (it may be gone already).
        if self._predecessor is not None and self._predecessor[0] > min_refit:
            sources.append(self._predecessor[1])
        return sources, policy_done(barrier, progress, self.connection.config.transfer.refits)

    async def _try(
        self, sources: list[SeedSource], resolve: TargetResolver, min_refit: int, attempt: int
    ) -> Seeded | None:
        engine = self.connection.engine
        try:
            seeded = await pull(
                engine.common.agent,
                engine.common.registry,
                engine.common.device,
                sources,
                min_refit=min_refit,
                resolve=resolve,
                timeout_s=min(self.connection.config.transfer.timeout_seconds, SEED_TIMEOUT_S),
                verifier=engine.common.verifier,
            )
        except SeedError as exc:
            log.warning("rollout rank %d: seed try %d failed: %s", self.rank, attempt, exc)
            return None
        log.info(
            "rollout rank %d: seeded refit %d from %s: %d bytes in %.3fs",
            self.rank,
            seeded.refit,
            ", ".join(seeded.sources),
            seeded.bytes,
            seeded.seconds,
        )
        return seeded

    async def stay(
        self, look: Look, *, holds: int, timeout_s: float, why: str, absolute: bool = False
    ) -> bool:
        """Keep this rank's offer readable until ``look()`` says stop (True), or until
        ``timeout_s`` passed without a change in what it sees (``absolute``: at all)
        (False).  Meanwhile the policy's sends of refits this rank holds (ids < ``holds``)
        are declined."""
        engine = self.connection.engine
        seen: Hashable = None
        changed = time.monotonic()
        next_look = changed
        while True:
            now = time.monotonic()
            if now >= next_look:
                stop, saw = await asyncio.to_thread(look)
                if stop:
                    return True
                if saw != seen and not absolute:
                    seen, changed = saw, now
                next_look = now + LOOK_INTERVAL_S
            if now - changed > timeout_s:
                log.info(
                    "rollout rank %d: stopped staying (%s) after %gs without a change",
                    self.rank,
                    why,
                    timeout_s,
                )
                return False
            engine.decline_pending(holds, f"it holds refit {holds - 1} and stays to seed")
            await asyncio.sleep(PROGRESS_INTERVAL_S)

    def close(self) -> None:
        """Withdraw the offer (before the engine's agent goes)."""
        if self._offer is not None and self.connection.connected:
            try:
                self._offer.close()
            except Exception as exc:  # teardown goes on regardless
                log.warning("rollout rank %d: withdrawing the seed offer: %s", self.rank, exc)
        self._offer = None


__all__ = ["SEED_TIMEOUT_S", "SEED_TRIES", "PeerSeeds"]
