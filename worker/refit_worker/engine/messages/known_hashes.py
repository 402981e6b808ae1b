"""Tensor hashes the receive path already computed, so the commit's offer need not hash again.

A rollout rank that checks integrity hashes every piece of every bucket over the memory it
landed in (:mod:`.integrity`).  When a piece is a whole tensor and landed straight in that
tensor's memory, its hash *is* the tensor's hash, and it equals the sender's once the
bucket is verified.  The peer-seed offer (:mod:`refit_worker.engine.rollout.seed_transfer`)
needs one hash per committed tensor; without this it hashed the whole state again on the
rank's main thread after every commit (0.19 s of a 0.66 s refit of 1.15 GiB on the 2-core
host), and a refit's next one could not begin until it was done.

Tensors that arrived in several pieces are hashed whole in the pool once the refit is
verified (after ``done`` is confirmed, beside the commit).  Each hash is tied to the
memory it read (address and size): a committed tensor anywhere else is hashed afresh, so
a hash can only describe the bytes it was computed over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..base import TensorMeta
from .integrity import Algorithm, Hasher, as_bytes, hash_bytes

#: How long an offer waits for a pool hash before hashing the tensor itself.
WAIT_S = 60.0


@dataclass(frozen=True, slots=True)
class KnownHash:
    """The hash of ``nbytes`` bytes at ``address``: item ``index`` of ``future``'s result."""

    address: int
    nbytes: int
    future: Future[tuple[int, ...]]
    index: int = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        return (self.address, self.nbytes) == (
            tensor.data_ptr(),
            tensor.numel() * tensor.element_size(),
        )


class KnownHashes:
    """What one refit's receive hashed, by tensor name (fed by the receiver)."""

    def __init__(self) -> None:
        self.by_name: dict[str, KnownHash] = {}

    def verified(
        self,
        pieces: Sequence[TensorMeta],
        future: Future[tuple[int, ...]],
        memory: Mapping[str, torch.Tensor],
        landed: Sequence[bool],
    ) -> None:
        """A bucket whose hashes equal the sender's: keep those of whole tensors that
        landed in their own memory (``landed[i]``: piece ``i`` did)."""
        for index, (piece, straight) in enumerate(zip(pieces, landed, strict=True)):
            where = memory.get(piece.name)
            if straight and piece.is_whole and where is not None:
                self.by_name[piece.name] = KnownHash(where.data_ptr(), where.numel(), future, index)

    def hash_the_rest(
        self, memory: Mapping[str, torch.Tensor], hasher: Hasher, algorithm: Algorithm
    ) -> None:
        """Queue a whole-tensor hash of every landed tensor no piece covered alone."""
        for name, where in memory.items():
            if name not in self.by_name and where.numel():
                future = hasher.submit([where], algorithm)
                self.by_name[name] = KnownHash(where.data_ptr(), where.numel(), future)


def tensor_hashes(
    named: Mapping[str, torch.Tensor],
    algorithm: Algorithm,
    known: Mapping[str, KnownHash],
) -> dict[str, int]:
    """One hash per tensor: the receive path's where it read this very memory, else
    computed here (also when its pool hash failed or did not come within ``WAIT_S``)."""
    out: dict[str, int] = {}
    for name, tensor in named.items():
        hint = known.get(name)
        if hint is not None and hint.fits(tensor):
            try:
                out[name] = hint.future.result(timeout=WAIT_S)[hint.index]
                continue
            except Exception:  # failed, cancelled or late: hash it here
                pass
        out[name] = hash_bytes(as_bytes(tensor), algorithm)
    return out


__all__ = ["KnownHash", "KnownHashes", "tensor_hashes"]
