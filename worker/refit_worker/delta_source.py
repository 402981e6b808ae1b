""":class:`DeltaSource`: a policy rank's side of delta refits (``transfer.delta``).

It keeps a copy of the weights as last sent and that version's whole-state digest.  For
each refit it offers the elements that changed since (:mod:`~refit_worker.checkpoint_engines.delta`)
when they are worth sending, with the digest the receiver's result must have; the refit's
first round sends that, every later round (a replica that lacked the base, a result that
failed the check, a late member) the whole weights.  Once a refit reached its members the
copy is brought up to it.

``on`` sends a delta whenever it is at most half the bytes.  ``auto`` also asks whether
deltas pay here (:func:`prefer_delta`): on a fast link (shared memory, a fast NIC) the
passes over the weights that find and apply the changes can cost more than the bytes
they save (``bench/delta_refit.py`` measured that on a 2-core host), so it keeps the
seconds of the last whole and the last delta refit and sends whichever was faster,
trying a delta again every :data:`PROBE_EVERY` refits.

Must not import: the operator, kubernetes, torch.distributed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from refit_worker.checkpoint_engines.delta import (
    DELTA_TENSOR,
    Delta,
    DeltaArena,
    base_bytes,
    encode_delta,
    worth_sending,
)
from refit_worker.checkpoint_engines.integrity import tensors_digest
from refit_worker.checkpoint_engines.messages import DeltaHeader

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
        digest = offer.digest
        current = _contiguous(items)
        copy = self._copy
        if copy is None or not _same_layout(current, copy):
            copy = {name: torch.empty_like(t) for name, t in current.items()}
        for name, tensor in current.items():
            copy[name].copy_(tensor)
        self._copy, self._version = copy, (refit, digest)


def _contiguous(items: Items) -> dict[str, torch.Tensor]:
    return {name: t if t.is_contiguous() else t.contiguous() for name, t in items}


def _same_layout(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and a[n].device == b[n].device
        for n in a
    )


__all__ = ["PROBE_EVERY", "DeltaSource", "Offer", "prefer_delta"]
