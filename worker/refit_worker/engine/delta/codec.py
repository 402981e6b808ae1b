"""Delta refits: the elements that changed since a version, and applying them onto it.

Granularity: single elements (a flat index and the new value), not blocks.  Between two RL
steps a bf16 weight changes only where the optimiser's update crosses a bf16 rounding
boundary, and those elements are scattered over every tensor: ``bench/delta_refit.py``
measures about 2% of the elements per AdamW step at lr 1e-6 and 12-15% at 1e-5.  Spread
evenly, 2% leaves a 4 KiB block (2048 bf16 elements) unchanged with probability
0.98^2048 (about 1e-18), so blocks would move everything.  An element costs its index
(4 bytes, 8 beyond 2^31 elements) plus its value, 6 bytes for bf16; a delta is sent only
while it is at most half the whole refit's bytes (:func:`worth_sending`), i.e. up to about
a sixth of the bf16 elements changed.

Comparison is of the bits, not the values: ``-0.0`` and ``0.0`` differ, a NaN equals the
same NaN, so the receiver ends with the sender's exact bytes.

The delta travels as one ``uint8`` tensor (``DELTA_TENSOR``) whose layout the
:class:`~refit_worker.engine.messages.wire.DeltaHeader` lists; both sides keep its memory across
refits (:class:`DeltaArena`), so it is registered with NIXL once, not per refit.

:func:`apply_delta` checks every entry against the base before it writes, writes only into
the spare copy, and compares the result's whole-state digest with the trainer's: a delta
that does not reproduce the trainer's state raises :class:`DeltaRejectedError` and the
served weights are untouched.  A sharded trainer's delta (:mod:`.blocks`) has one
entry per changed block, indices flat within the block, and its whole-state check is by
block: the header lists every block's hash.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ..base import SAME_WIDTH_INT, dtype_name
from ..messages.integrity import Algorithm, as_bytes, tensors_digest
from ..messages.wire import BlockRef, DeltaEntry, DeltaHeader
from ..planning.boxes import Box
from .blocks import PIECE_ALIGN, global_index, place_block, state_blocks_digest

#: The one tensor a delta refit sends (its manifest lists nothing else).
DELTA_TENSOR = "kube-refit/delta"
_ALIGN = PIECE_ALIGN  # a sharded delta lays the ranks' pieces end to end: whole words
_INDEX = {"int32": torch.int32, "int64": torch.int64}
#: A delta is sent only while its bytes stay under this share of the whole refit's.
MAX_SHARE = 0.5


class DeltaRejectedError(ValueError):
    """A delta that cannot be applied onto this base, or whose result is not the trainer's."""


@dataclass(frozen=True, slots=True)
class Delta:
    """An encoded delta: its header (the base still to be filled in) and its bytes."""

    entries: tuple[DeltaEntry, ...]
    data: torch.Tensor  # uint8, a view of the arena
    changed: int  # elements
    total: int  # elements
    #: The tensors compared (those without an entry did not change).
    compared: frozenset[str] = frozenset()

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.total if self.total else 0.0

    def header(self, base_refit: int, base_digest: str, digest: str) -> DeltaHeader:
        return DeltaHeader(
            base_refit=base_refit,
            base_digest=base_digest,
            digest=digest,
            nbytes=self.nbytes,
            entries=self.entries,
        )


class DeltaArena:
    """A ``uint8`` buffer kept across refits, grown (by half again) when a delta needs more,
    so that the memory NIXL reads or writes stays the same registration."""

    def __init__(self) -> None:
        self._memory: torch.Tensor | None = None

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A view of ``nbytes`` bytes (contents undefined)."""
        memory = self._memory
        if memory is None or memory.numel() < nbytes or memory.device != device:
            size = max(nbytes, int(nbytes * 1.5), 1 << 16)
            memory = self._memory = torch.empty(size, dtype=torch.uint8, device=device)
        return memory[:nbytes]

    def clear(self) -> None:
        self._memory = None


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (flat, no copy)."""
    return tensor.reshape(-1).view(SAME_WIDTH_INT[tensor.element_size()])


def _changed(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Flat indices (int64, ascending) of the elements whose bits differ.  On the host
    numpy's ``flatnonzero`` does it: 2.5-3x torch's ``nonzero`` on this host (1.3-1.5 vs
    0.5 GB/s of bf16 weights, measured side by side), the largest part of a delta's cost."""
    if now.device.type != "cpu":
        return torch.nonzero(_bits(now) != _bits(before)).reshape(-1)
    a, b = _bits(now).detach().numpy(), _bits(before).detach().numpy()
    return torch.from_numpy(np.flatnonzero(a != b))


def _align(value: int) -> int:
    return -(-value // _ALIGN) * _ALIGN


def encode_delta(
    current: Mapping[str, torch.Tensor],
    previous: Mapping[str, torch.Tensor],
    arena: DeltaArena,
    blocks: Mapping[str, BlockRef] | None = None,
) -> Delta:
    """The elements of ``current`` whose bits differ from ``previous`` (same names, dtypes
    and shapes, contiguous), packed into ``arena``'s memory on ``current``'s device.

    ``blocks``: a sharded sender's local shards, each tensor the block it names of a
    global tensor (:mod:`.blocks`); the entries carry it."""
    if set(current) != set(previous):
        raise ValueError(
            f"the weights changed their names since the base: added "
            f"{sorted(set(current) - set(previous))[:5]}, removed "
            f"{sorted(set(previous) - set(current))[:5]}"
        )
    found: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    total = changed = 0
    for name in sorted(current):
        now, before = current[name], previous[name]
        if now.dtype != before.dtype or now.shape != before.shape:
            raise ValueError(f"tensor {name!r} changed its dtype or shape since the base")
        total += now.numel()
        if now.numel() == 0:
            continue
        index = _changed(now, before)
        if index.numel():
            found.append((name, now, index))
            changed += index.numel()
    entries: list[DeltaEntry] = []
    cursor = 0
    for name, tensor, index in found:
        block = None if blocks is None else blocks[name]
        entry = _entry(name, tensor, index.numel(), _align(cursor), block)
        entries.append(entry)
        cursor = entry.values_offset + entry.count * tensor.element_size()
    device = next(iter(current.values())).device if current else torch.device("cpu")
    # Whole words: a sharded refit lays the ranks' deltas end to end, each aligned.
    data = arena.take(_align(cursor), device)
    data[cursor:].zero_()
    for entry, (_, tensor, index) in zip(entries, found, strict=True):
        _slot(data, entry.offset, entry.count, _INDEX[entry.index_dtype]).copy_(index)
        values = tensor.reshape(-1)[index]
        _slot(data, entry.values_offset, entry.count, tensor.dtype).copy_(values)
    return Delta(tuple(entries), data, changed, total, frozenset(current))


def scatter_changes(delta: Delta, into: Mapping[str, torch.Tensor]) -> None:
    """Write ``delta``'s changed elements into ``into``, tensors laid out as the ones it was
    encoded from (a sharded rank's local blocks): bits, not values, so ``-0.0`` and NaN
    payloads are kept.  A copy that equalled the base then equals the encoded weights
    at the cost of the changed elements, not of a pass over all of them."""
    for entry in delta.entries:
        target = _bits(into[entry.name])
        index = _slot(delta.data, entry.offset, entry.count, _INDEX[entry.index_dtype])
        target[index.long()] = _slot(delta.data, entry.values_offset, entry.count, target.dtype)


def _entry(
    name: str, tensor: torch.Tensor, count: int, offset: int, block: BlockRef | None
) -> DeltaEntry:
    """The entry of ``count`` changed elements of ``tensor`` whose indices start at byte
    ``offset`` (its values follow, aligned)."""
    if block is not None and math.prod(block.size) != tensor.numel():
        raise ValueError(
            f"tensor {name!r}: the local shard has {tensor.numel()} elements, its block "
            f"{block.offset}+{block.size} {math.prod(block.size)}"
        )
    kind: Literal["int32", "int64"] = "int32" if tensor.numel() < 2**31 else "int64"
    return DeltaEntry(
        name=name,
        dtype=dtype_name(tensor.dtype),
        numel=tensor.numel(),
        count=count,
        index_dtype=kind,
        offset=offset,
        values_offset=_align(offset + count * _INDEX[kind].itemsize),
        block=block,
    )


def _slot(data: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    return data[offset : offset + count * dtype.itemsize].view(dtype)


def worth_sending(delta_bytes: int, whole_bytes: int) -> bool:
    """Whether a delta of ``delta_bytes`` is worth sending instead of ``whole_bytes``."""
    return delta_bytes <= MAX_SHARE * whole_bytes


def check_delta(header: DeltaHeader, data: torch.Tensor, base: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`DeltaRejectedError` naming the first entry that does not fit ``base``
    or lies outside ``data``; writes nothing."""
    if data.numel() != header.nbytes:
        raise DeltaRejectedError(
            f"the delta has {data.numel()} bytes, its header says {header.nbytes}"
        )
    seen: dict[str, list[Box] | None] = {}
    for entry in header.entries:
        tensor = base.get(entry.name)
        if tensor is None:
            raise DeltaRejectedError(f"the delta names tensor {entry.name!r}, which the base lacks")
        _check_block(entry, tensor, seen)
        if entry.dtype != dtype_name(tensor.dtype) or entry.numel != _entry_numel(entry, tensor):
            raise DeltaRejectedError(
                f"tensor {entry.name!r}: the delta is for {entry.numel} x {entry.dtype}, the "
                f"base holds {tensor.numel()} x {dtype_name(tensor.dtype)}"
            )
        index_end = entry.offset + entry.count * _INDEX[entry.index_dtype].itemsize
        values_end = entry.values_offset + entry.count * tensor.element_size()
        misaligned = entry.offset % _ALIGN or entry.values_offset % _ALIGN
        if misaligned or index_end > entry.values_offset or values_end > header.nbytes:
            raise DeltaRejectedError(f"tensor {entry.name!r}: its entry lies outside the delta")
        index = _slot(data, entry.offset, entry.count, _INDEX[entry.index_dtype])
        if int(index.min()) < 0 or int(index.max()) >= entry.numel:
            raise DeltaRejectedError(
                f"tensor {entry.name!r}: an index lies outside its {entry.numel} elements"
            )


def _entry_numel(entry: DeltaEntry, tensor: torch.Tensor) -> int:
    """The elements an entry's indices run over: its block's, else the tensor's."""
    return tensor.numel() if entry.block is None else math.prod(entry.block.size)


def _check_block(
    entry: DeltaEntry, tensor: torch.Tensor, seen: dict[str, list[Box] | None]
) -> None:
    """An entry's block must be a block of ``tensor`` that no other entry of it overlaps;
    an entry without a block (the whole tensor, ``None`` in ``seen``) must be its only one."""
    name, block = entry.name, entry.block
    placed = seen.get(name, [])
    if placed is None or (block is None and name in seen):
        raise DeltaRejectedError(f"the delta lists tensor {name!r} twice")
    if block is None:
        seen[name] = None
        return
    problem = place_block(placed, block, tensor.shape)
    if problem is not None:
        raise DeltaRejectedError(f"the delta lists tensor {name!r} twice or outside it: {problem}")
    seen[name] = placed


def apply_delta(
    header: DeltaHeader,
    data: torch.Tensor,
    base: Mapping[str, torch.Tensor],
    spare: Mapping[str, torch.Tensor],
    algorithm: Algorithm | None = None,
) -> str:
    """Fill ``spare`` with ``base`` plus the delta and return the result's whole-state
    digest, which must be the header's (else :class:`DeltaRejectedError`; ``spare`` then
    holds garbage, ``base`` is untouched)."""
    if set(base) != set(spare):
        raise DeltaRejectedError("the spare copy does not hold the base's tensors")
    check_delta(header, data, base)
    for name, tensor in base.items():
        spare[name].copy_(tensor)
    for entry in header.entries:
        target = spare[entry.name]
        index = _slot(data, entry.offset, entry.count, _INDEX[entry.index_dtype])
        flat = index.long() if entry.block is None else global_index(index, entry.block)
        values = _slot(data, entry.values_offset, entry.count, target.dtype)
        target.view(-1)[flat] = values
    where = ""
    if header.blocks is None:
        digest = tensors_digest(spare, algorithm)
    else:
        try:
            digest, first = state_blocks_digest(spare, header.blocks, blocks_algorithm(header))
        except ValueError as exc:
            raise DeltaRejectedError(f"the delta's blocks do not fit the base: {exc}") from exc
        if first is not None:
            where = (
                f" (first differing: {first.name!r} block {first.block.offset}+{first.block.size})"
            )
    if digest != header.digest:
        raise DeltaRejectedError(
            f"the delta onto refit {header.base_refit} gives state {digest}, the trainer's is "
            f"{header.digest}{where}: rejected, the served weights are unchanged"
        )
    return digest


def blocks_algorithm(header: DeltaHeader) -> Algorithm:
    """The hash a sharded delta's blocks were taken with (its digest's prefix): the
    receiver hashes its result's blocks the same way."""
    name = header.digest.split("/", 1)[0]
    if name == "xxh3_64":
        return "xxh3_64"
    if name == "wsum64":
        return "wsum64"
    raise ValueError(f"the delta's digest {header.digest!r} names no known hash")


def base_bytes(named: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a whole refit of ``named``."""
    return sum(as_bytes(t).numel() for t in named.values() if t.numel())


__all__ = [
    "DELTA_TENSOR",
    "MAX_SHARE",
    "Delta",
    "DeltaArena",
    "DeltaRejectedError",
    "apply_delta",
    "base_bytes",
    "blocks_algorithm",
    "check_delta",
    "encode_delta",
    "scatter_changes",
    "worth_sending",
]
