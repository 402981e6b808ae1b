""":class:`DeltaBase`: the version a rollout rank's next delta refit applies to.

A delta is applied onto the committed state, into a spare copy, and checked whole before
it commits.  A sharded delta also names the blocks its trainer cut the state into; the
served version's digest in those blocks is what the trainer's base digest must equal.  When
the served version itself came as a sharded delta in the same blocks, that digest is already
known (it was verified on arrival), so it is kept with the commit instead of hashing the
whole state again.  What the arriving refit changed (:class:`DeltaChanges`) is kept for the
engine that lands only what changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from refit_worker.contract.entries import ServedVersion
from refit_worker.engine import (
    BlocksKey,
    DeltaHeader,
    DeltaTarget,
    apply_delta,
    blocks_algorithm,
    blocks_key,
    state_blocks_digest,
)
from refit_worker.session.refits import CommittedRefit, DeltaChanges

log = logging.getLogger(__name__)


class DeltaBase:
    """One rollout rank's delta bookkeeping across its receives: the arriving refit's
    changes, the blocks digest it verified, and the committed version's."""

    def __init__(self, rank: int, committed: Callable[[], CommittedRefit | None]) -> None:
        self._rank = rank
        self._committed = committed
        #: Of the refit being received (set when it applies as a sharded delta).
        self._pending: tuple[BlocksKey, str] | None = None
        #: Of the committed refit: its id, blocks and digest.
        self._known: tuple[int, BlocksKey, str] | None = None
        #: What the refit being received changed, when it came as a delta.
        self.arrived: DeltaChanges | None = None

    def target(
        self, served: ServedVersion | None, spare: Callable[[], Mapping[str, torch.Tensor]]
    ) -> DeltaTarget:
        """How this receive takes a delta: onto ``served`` (None: it declines deltas),
        applied into ``spare()`` and checked whole before it commits."""
        self.whole()

        def apply(header: DeltaHeader, data: torch.Tensor) -> Mapping[str, torch.Tensor]:
            filled = spare()
            apply_delta(header, data, self._state(), filled)
            if header.blocks is not None:  # the next sharded delta's base: no hash again
                self._pending = (blocks_key(header.blocks), header.digest)
            log.info(
                "rollout rank %d: refit applied as a delta onto refit %d (%d tensors "
                "changed, %d bytes); whole-state digest %s matches the trainer's",
                self._rank,
                header.base_refit,
                len(header.entries),
                header.nbytes,
                header.digest,
            )
            return filled

        return DeltaTarget(served, apply, self.blocks_digest)

    def whole(self) -> None:
        """The refit being received is not (or not yet) a delta: in place, or starting."""
        self._pending = None
        self.arrived = None

    def landed(self, header: DeltaHeader | None) -> None:
        """The refit landed, as a delta with ``header`` or whole (None)."""
        self.arrived = (
            None
            if header is None
            else DeltaChanges(header.base_refit, frozenset(e.name for e in header.entries))
        )

    def committed(self, refit_id: int) -> None:
        """Refit ``refit_id`` is committed: what its delta verified is now the base's."""
        pending, self._pending = self._pending, None
        self._known = None if pending is None else (refit_id, *pending)

    def blocks_digest(self, header: DeltaHeader) -> str:
        """The served version's digest in a sharded delta's blocks: known when that version
        came as a sharded delta in the same blocks, else hashed here."""
        blocks = header.blocks or ()
        committed = self._committed()
        if committed is None:
            raise ValueError("no version is served")
        known = self._known
        if known is not None and known[:2] == (committed.refit_id, blocks_key(blocks)):
            return known[2]
        return state_blocks_digest(committed.state, blocks, blocks_algorithm(header))[0]

    def _state(self) -> Mapping[str, torch.Tensor]:
        committed = self._committed()
        return {} if committed is None else committed.state
