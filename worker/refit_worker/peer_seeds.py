""":class:`PeerSeeds`: a rollout session's part in peer seeding (issue #31).

After every commit the rank offers what it committed
(:class:`~.checkpoint_engines.seeding.SeedOffer`: rewritten in place, the pointer
published with the rank's metadata the first time and whenever it moves).  A rank that
has committed nothing yet tries, before it waits for the policy's send, to seed the last
committed refit from live rollout peers (:func:`~.checkpoint_engines.seeding.pull`,
striped over the peers that agree, every tensor verified); when no peer qualifies or the
seed fails, it takes the policy's send as before.

Must not import: the operator, kubernetes (the store does that lazily).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import torch

from refit_worker.checkpoint_engines.receiver import TargetResolver
from refit_worker.checkpoint_engines.seeding import (
    Seeded,
    SeedError,
    SeedOffer,
    SeedSource,
    pointer_metadata,
    pull,
)
from refit_worker.connection import Connection
from refit_worker.contract.entries import SeedPointer
from refit_worker.seeding import seed_sources

log = logging.getLogger(__name__)

#: Tries at a seed before the policy's send is taken: a try fails when a peer moved on to
#: a newer refit while it was read, and the next try reads the newer one.
SEED_TRIES = 3
#: The longest one try waits for a peer's READs: a seed should take a fraction of a
#: refit's time, and a slow peer must not hold up the policy's send for the whole timeout.
SEED_TIMEOUT_S = 30.0


class PeerSeeds:
    """Offer this rank's commits to peers, and seed its first one from them."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._offer: SeedOffer | None = None

    @property
    def rank(self) -> int:
        return self.connection.config.rank

    def offer(self, refit: int, committed: Mapping[str, torch.Tensor]) -> None:
        """Offer refit ``refit`` (the committed tensors); best effort: a rank that cannot
        offer still serves, its peers then take the policy's send."""
        if not self.connection.connected:
            return
        engine = self.connection.engine
        try:
            if self._offer is None:
                self._offer = SeedOffer(engine.agent, engine.registry, engine.device)
            moved = self._offer.publish(refit, committed)
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

    def _sources(self, min_refit: int) -> list[SeedSource]:
        store, member = self.connection.store, self.connection.member
        barrier = store.barrier(member.epoch)
        if barrier is None:
            return []
        snapshot = store.snapshot(barrier.epoch)
        return seed_sources(
            barrier, snapshot.meta, store.progress_all(), me=self.rank, min_refit=min_refit
        )

    async def take(self, resolve: TargetResolver, min_refit: int) -> Seeded | None:
        """Seed refit >= ``min_refit`` from live peers into ``resolve(specs)``; None when
        none qualifies or every try failed (the caller takes the policy's send)."""
        engine = self.connection.engine
        timeout = min(self.connection.config.transfer.timeout_seconds, SEED_TIMEOUT_S)
        for attempt in range(1, SEED_TRIES + 1):
            sources = await asyncio.to_thread(self._sources, min_refit)
            if not sources:
                if attempt == 1:
                    log.info(
                        "rollout rank %d: no live peer offers refit >= %d; taking the "
                        "policy's send",
                        self.rank,
                        min_refit,
                    )
                return None
            try:
                seeded = await pull(
                    engine.agent,
                    engine.registry,
                    engine.device,
                    sources,
                    min_refit=min_refit,
                    resolve=resolve,
                    timeout_s=timeout,
                )
            except SeedError as exc:
                log.warning(
                    "rollout rank %d: seed try %d/%d failed: %s",
                    self.rank,
                    attempt,
                    SEED_TRIES,
                    exc,
                )
                continue
            log.info(
                "rollout rank %d: seeded refit %d from %s: %d bytes in %.3fs",
                self.rank,
                seeded.refit,
                ", ".join(seeded.sources),
                seeded.bytes,
                seeded.seconds,
            )
            return seeded
        return None

    def close(self) -> None:
        """Withdraw the offer (before the engine's agent goes)."""
        if self._offer is not None and self.connection.connected:
            try:
                self._offer.close()
            except Exception as exc:  # teardown goes on regardless
                log.warning("rollout rank %d: withdrawing the seed offer: %s", self.rank, exc)
        self._offer = None


__all__ = ["SEED_TIMEOUT_S", "SEED_TRIES", "PeerSeeds"]
