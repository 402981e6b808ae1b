""":class:`DeltaSource`: a policy rank's side of delta refits (``transfer.delta``).

It keeps a copy of the weights as last sent and that version's whole-state digest.  For
each refit it offers the elements that changed since (:mod:`~refit_worker.engine.delta.codec`)
when they are worth sending, with the digest the receiver's result must have; the refit's
first round sends that, every later round (a replica that lacked the base, a result that
failed the check, a late member) the whole weights.  Once a refit reached its members the
copy is brought up to it.  A DTensor trainer's rank keeps a copy of its own blocks only,
and its offer is agreed with the other ranks (:meth:`DeltaSource.offer_sharded`,
:mod:`refit_worker.policy.delta_agreement`).

``on`` sends a delta whenever it is at most half the bytes.  ``auto`` also asks whether
deltas pay here (:func:`prefer_delta`): on a fast link (shared memory, a fast NIC) the
passes over the weights that find and apply the changes can cost more than the bytes
they save (``bench/delta_refit.py`` measured that on a 2-core host), so it keeps the
seconds of the last whole and the last delta refit and sends whichever was faster,
trying a delta again every :data:`PROBE_EVERY` refits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from refit_worker.engine import (
    DELTA_TENSOR,
    Algorithm,
    BlockHash,
    BlockRef,
    Box,
    Delta,
    DeltaArena,
    DeltaHeader,
    ShardedSource,
    base_bytes,
    block_ref,
    encode_delta,
    encoded_here,
    hash_blocks,
    scatter_changes,
    tensors_digest,
    worth_sending,
)
from refit_worker.policy.delta_agreement import RankOffer, fold_offers

log = logging.getLogger(__name__)

Items = Sequence[tuple[str, torch.Tensor]]
Mode = Literal["on", "auto"]
#: ``auto``: whole refits in a row before a delta is tried again.
PROBE_EVERY = 8


def prefer_delta(mode: Mode, whole_s: float | None, delta_s: float | None, since: int) -> bool:
    """Whether to try a delta for the next refit (pure): always with ``on``; with ``auto``
    until a delta refit was measured slower than a whole one, then again once ``since``
    (whole refits since the last delta) reaches :data:`PROBE_EVERY`."""
    if mode == "on" or whole_s is None or delta_s is None:
        return True
    return delta_s < whole_s or since >= PROBE_EVERY


@dataclass(frozen=True, slots=True)
class Offer:
    """What one refit's first round sends: the delta's one tensor and header, or None (the
    refit goes whole), and the digest of the whole weights either way."""

    digest: str
    header: DeltaHeader | None
    items: list[tuple[str, torch.Tensor]]
    delta: Delta | None
    #: When the offer was made (the refit's time runs from here: encoding is part of it).
    started: float = 0.0
    #: A sharded refit: every rank's piece of the delta tensor (None: not sharded, or
    #: whole), and this rank's blocks of the weights (what :meth:`DeltaSource.sent` copies).
    pieces: tuple[tuple[int, Box], ...] | None = None
    local: dict[str, torch.Tensor] | None = None


class DeltaSource:
    """The weights as last sent (a copy), their version, and the deltas since."""

    def __init__(self, rank: int, mode: Mode = "on") -> None:
        self.rank, self.mode = rank, mode
        self._copy: dict[str, torch.Tensor] | None = None
        self._version: tuple[int, str] | None = None  # (refit, whole-state digest)
        self._arena = DeltaArena()
        #: Seconds of the last whole and the last delta refit, whole refits since a delta.
        self._whole_s: float | None = None
        self._delta_s: float | None = None
        self._since = 0
        #: Why deltas stopped for good (None: they go on).
        self.refused: str | None = None

    def offer(self, items: Items, refit: int) -> Offer:
        """The first round's payload for refit ``refit`` of ``items``."""
        started = time.perf_counter()
        current = _contiguous(items)
        digest = tensors_digest(current)
        copy, version = self._copy, self._version
        if copy is None or version is None or not _same_layout(current, copy):
            return Offer(digest, None, list(current.items()), None, started)
        if not prefer_delta(self.mode, self._whole_s, self._delta_s, self._since):
            return Offer(digest, None, list(current.items()), None, started)
        delta = encode_delta(current, copy, self._arena)
        whole = base_bytes(current)
        if not worth_sending(delta.nbytes, whole):
            log.info(
                "policy rank %d: refit %d goes whole: %.1f%% of the elements changed, a delta "
                "would be %d of %d bytes",
                self.rank,
                refit,
                100 * delta.changed_fraction,
                delta.nbytes,
                whole,
            )
            return Offer(digest, None, list(current.items()), delta, started)
        header = delta.header(version[0], version[1], digest)
        log.info(
            "policy rank %d: refit %d as a delta onto refit %d: %.2f%% of the elements "
            "changed, %d of %d bytes",
            self.rank,
            refit,
            version[0],
            100 * delta.changed_fraction,
            delta.nbytes,
            whole,
        )
        return Offer(digest, header, [(DELTA_TENSOR, delta.data)], delta, started)

    def offer_sharded(
        self,
        local: Sequence[ShardedSource],
        refit: int,
        exchange: Callable[[bytes], list[bytes]],
        algorithm: Algorithm,
    ) -> Offer:
        """The first round's payload for refit ``refit`` of a DTensor trainer's weights
        (``local``: this rank's blocks), agreed with the other policy ranks through
        ``exchange`` (every rank's bytes, in rank order): all send a delta, each its own
        piece, or all send whole (:mod:`refit_worker.policy.delta_agreement`)."""
        started = time.perf_counter()
        current = {s.held.name: s.local for s in local}
        refs = {s.held.name: block_ref(s.held.shape, _own_box(s, self.rank)) for s in local}
        mine = [
            s.held.name
            for index, s in enumerate(local)
            if encoded_here(s.held.boxes, self.rank, index)
        ]
        hashes = tuple(hash_blocks(current, refs, algorithm))
        mine_offer, delta = self._rank_offer(current, refs, mine, hashes)
        offers = [
            RankOffer.model_validate_json(data)
            for data in exchange(mine_offer.model_dump_json().encode())
        ]
        gang = fold_offers(offers, algorithm)
        if gang.header is None or delta is None:
            if self._version is not None:
                log.info(
                    "policy rank %d: refit %d goes whole: %s", self.rank, refit, gang.why_whole
                )
            return Offer(gang.digest, None, [], None, started, local=current)
        log.info(
            "policy rank %d: refit %d as a delta onto refit %d, all policy ranks: %.2f%% of "
            "the elements changed, %d of %d bytes (%d of them this rank's)",
            self.rank,
            refit,
            gang.header.base_refit,
            100 * gang.changed_fraction,
            gang.nbytes,
            gang.whole,
            delta.nbytes,
        )
        return Offer(
            gang.digest,
            gang.header,
            [(DELTA_TENSOR, delta.data)],
            delta,
            started,
            pieces=gang.pieces,
            local=current,
        )

    def _rank_offer(
        self,
        current: dict[str, torch.Tensor],
        refs: dict[str, BlockRef],
        mine: list[str],
        hashes: tuple[BlockHash, ...],
    ) -> tuple[RankOffer, Delta | None]:
        """This rank's offer (and its delta, when it can send one): ``mine`` names the
        blocks it encodes of ``current`` (its blocks, ``refs``)."""
        copy, version = self._copy, self._version
        whole = sum(current[n].numel() * current[n].element_size() for n in mine)
        if (
            self.refused is not None
            or copy is None
            or version is None
            or not _same_layout(current, copy)
            or not prefer_delta(self.mode, self._whole_s, self._delta_s, self._since)
        ):
            return RankOffer(can=False, whole=whole, hashes=hashes), None
        delta = encode_delta(
            {n: current[n] for n in mine}, {n: copy[n] for n in mine}, self._arena, refs
        )
        offer = RankOffer(
            can=True,
            base_refit=version[0],
            base_digest=version[1],
            nbytes=delta.nbytes,
            entries=delta.entries,
            changed=delta.changed,
            total=delta.total,
            whole=whole,
            hashes=hashes,
        )
        return offer, delta

    def refuse(self, reason: str) -> None:
        """Send every later refit whole (a target reshapes what it receives).  A sharded
        rank still offers, so that the gang's exchanges stay in step."""
        self.refused = reason

    def sent(self, refit: int, items: Items, offer: Offer) -> None:
        """Refit ``refit`` (``offer``) reached its members: the next delta is onto it."""
        seconds = time.perf_counter() - offer.started
        if offer.header is not None:
            self._delta_s, self._since = seconds, 0
            if self.mode == "auto" and self._whole_s is not None and seconds >= self._whole_s:
                log.info(
                    "policy rank %d: refit %d: the delta took %.3fs, the last whole refit "
                    "%.3fs: sending whole (delta auto), trying a delta again in %d refits",
                    self.rank,
                    refit,
                    seconds,
                    self._whole_s,
                    PROBE_EVERY,
                )
        else:
            self._whole_s = seconds
            self._since += 1
        current = offer.local if offer.local is not None else _contiguous(items)
        self._copy = self._brought_up(current, offer)
        self._version = (refit, offer.digest)

    def _brought_up(
        self, current: dict[str, torch.Tensor], offer: Offer
    ) -> dict[str, torch.Tensor]:
        """The copy made equal to ``current``: after a delta, the tensors it compared
        differ from the copy only where it says, so only those elements are written (a
        full copy of the weights was a pass of its own per refit); the rest is copied."""
        copy = self._copy
        if copy is None or not _same_layout(current, copy):
            copy = {name: torch.empty_like(t) for name, t in current.items()}
            delta = None
        else:
            delta = offer.delta if offer.header is not None else None
        compared = delta.compared if delta is not None else frozenset()
        for name, tensor in current.items():
            if name not in compared:
                copy[name].copy_(tensor)
        if delta is not None:
            scatter_changes(delta, copy)
        return copy


def _own_box(source: ShardedSource, rank: int) -> Box:
    return next(box for r, box in source.held.boxes if r == rank)


def _contiguous(items: Items) -> dict[str, torch.Tensor]:
    return {name: t if t.is_contiguous() else t.contiguous() for name, t in items}


def _same_layout(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and a[n].device == b[n].device
        for n in a
    )


__all__ = ["PROBE_EVERY", "DeltaSource", "Offer", "prefer_delta"]
