"""A sharded refit's delta, agreed by the policy gang: each rank's offer, and their fold.

Each policy rank of a DTensor trainer encodes the changes of its own blocks
(:mod:`refit_worker.engine.delta.blocks`) and offers them as a :class:`RankOffer`:
whether it can send a delta at all (it holds the base, and ``auto`` says deltas pay), its
piece's entries and size, and the hashes of its blocks.  The ranks exchange their offers over
the policy group (JSON, :meth:`~refit_worker.policy.gang_plan.PolicyGang.exchange`) and every
rank folds the same list the same way (:func:`fold_offers`): one delta, sent by all of them,
each writing its own piece, or a whole refit, sent by all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from refit_worker.engine import (
    Algorithm,
    BlockHash,
    Box,
    DeltaEntry,
    DeltaHeader,
    blocks_digest,
    merge_hashes,
    merge_pieces,
    worth_sending,
)


class RankOffer(BaseModel):
    """One policy rank's part of a sharded refit's first round."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: This rank holds a base and would send a delta (False: it sends whole, so all do).
    can: bool
    #: The version its copy holds (refit, blocks digest); None before its first refit.
    base_refit: int | None = None
    base_digest: str | None = None
    #: Its piece: bytes (whole words), entries, changed and encoded elements, and the
    #: bytes of the blocks it encodes (what a whole refit moves of them).
    nbytes: int = Field(default=0, ge=0)
    entries: tuple[DeltaEntry, ...] = ()
    changed: int = Field(default=0, ge=0)
    total: int = Field(default=0, ge=0)
    whole: int = Field(default=0, ge=0)
    #: The hashes of its blocks of the current weights (every rank, delta or not: they
    #: are the version's digest).
    hashes: tuple[BlockHash, ...] = ()


@dataclass(frozen=True, slots=True)
class GangDelta:
    """What the ranks' offers fold into, the same on every rank."""

    #: The blocks digest of the weights being sent (the version this refit makes).
    digest: str
    #: The delta every rank sends (None: the refit goes whole), with each rank's piece of
    #: the delta tensor (``(rank, box)``, rank order).
    header: DeltaHeader | None
    pieces: tuple[tuple[int, Box], ...]
    #: Why the refit goes whole ('' when it is a delta).
    why_whole: str
    changed: int
    total: int
    nbytes: int
    whole: int

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.total if self.total else 0.0


def fold_offers(offers: Sequence[RankOffer], algorithm: Algorithm) -> GangDelta:
    """The gang's delta from every rank's offer, in rank order (pure).  Raises
    ``ValueError`` when replicated blocks differ between ranks."""
    hashes = merge_hashes([o.hashes for o in offers])
    digest = blocks_digest(algorithm, hashes)
    changed = sum(o.changed for o in offers)
    total = sum(o.total for o in offers)
    nbytes = sum(o.nbytes for o in offers)
    whole = sum(o.whole for o in offers)
    bases = {(o.base_refit, o.base_digest) for o in offers}
    why = ""
    unable = [rank for rank, o in enumerate(offers) if not o.can]
    if unable:
        why = f"policy ranks {unable} hold no base to diff against, or send whole (delta auto)"
    elif len(bases) != 1:
        why = f"the policy ranks hold different bases: {sorted(bases, key=str)[:4]}"
    elif not worth_sending(nbytes, whole):
        why = (
            f"{100 * changed / max(total, 1):.1f}% of the elements changed, a delta would be "
            f"{nbytes} of {whole} bytes"
        )
    if why:
        return GangDelta(digest, None, (), why, changed, total, nbytes, whole)
    ((base_refit, base_digest),) = bases
    if base_refit is None or base_digest is None:  # every rank said it can: it has a base
        raise ValueError("a rank offered a delta without a base")
    entries, starts, size = merge_pieces([(o.entries, o.nbytes) for o in offers])
    header = DeltaHeader(
        base_refit=base_refit,
        base_digest=base_digest,
        digest=digest,
        nbytes=size,
        entries=entries,
        blocks=hashes,
    )
    pieces = tuple(
        (rank, Box((start,), (o.nbytes,)))
        for rank, (start, o) in enumerate(zip(starts, offers, strict=True))
    )
    return GangDelta(digest, header, pieces, "", changed, total, nbytes, whole)


__all__ = ["GangDelta", "RankOffer", "fold_offers"]
