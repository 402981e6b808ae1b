"""Sharded delta refits: each policy rank's changes to its own blocks, one header for all.

A DTensor sender (FSDP2, tensor parallel) holds only its local blocks, so a delta is
found where the weights are: each rank compares its local shards with its copy of them
(:func:`~.codec.encode_delta`: indices flat within the block) and tags every entry with
its block's place in the global tensor (:class:`~refit_worker.engine.messages.wire.BlockRef`).  The
ranks' pieces lie end to end in one delta tensor (:func:`merge_pieces` shifts each rank's byte
offsets), each written by its own rank, so the receiver applies it as any delta, mapping
an index from its block to the global tensor (:func:`global_index`).

No rank holds a whole tensor, so no rank can hash one: the whole-state check of a
sharded delta is a digest of every block's hash (:func:`blocks_digest`).  Each rank
hashes its own blocks, the ranks exchange the hashes (a few bytes per block), and the
receiver hashes the same blocks of its result.  :func:`check_blocks` makes the blocks
cover every element of every tensor exactly once, so the check is as strict as the
whole tensors' digest: any byte that differs changes its block's hash.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import xxhash

from ..base import dtype_name
from ..messages.integrity import Algorithm, as_bytes, hash_bytes
from ..messages.wire import BlockHash, BlockRef, DeltaEntry
from ..planning.boxes import Box, intersect
from ..planning.shard_plan import choose_holders

#: Each rank's piece starts on this byte boundary (indices and values stay aligned).
PIECE_ALIGN = 8


#: Which blocks a sharded state is cut into (names, offsets and sizes; not the hashes).
BlocksKey = tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]


def blocks_key(blocks: Iterable[BlockHash]) -> BlocksKey:
    return tuple(sorted((h.name, h.block.offset, h.block.size) for h in blocks))


def box_of(block: BlockRef) -> Box:
    return Box(block.offset, block.size)


def block_ref(shape: Sequence[int], box: Box) -> BlockRef:
    return BlockRef(shape=tuple(shape), offset=box.offset, size=box.size)


def block_problem(block: BlockRef) -> str | None:
    """Why ``block`` is not a block of its tensor (None: it is)."""
    rank = len(block.shape)
    if len(block.offset) != rank or len(block.size) != rank:
        return f"block {block.offset}+{block.size} does not match the tensor's rank {rank}"
    if not box_of(block).within(Box.whole(block.shape)):
        return f"block {block.offset}+{block.size} lies outside the tensor's {block.shape}"
    return None


def place_block(placed: list[Box], block: BlockRef, shape: Sequence[int]) -> str | None:
    """Add ``block`` to ``placed`` (the blocks of a tensor of ``shape`` met so far), or
    say why it does not fit: not a block of that tensor, or overlapping one met before."""
    problem = block_problem(block)
    if problem is None and block.shape != tuple(shape):
        problem = f"the block is of a {list(block.shape)} tensor, not {list(shape)}"
    if problem is not None:
        return problem
    box = box_of(block)
    for other in placed:
        if box.numel and other.numel and intersect(box, other) is not None:
            return f"blocks {other} and {box} overlap"
    placed.append(box)
    return None


def encoded_here(boxes: Sequence[tuple[int, Box]], rank: int, index: int) -> bool:
    """Whether ``rank`` encodes the changes of its block of a tensor held as ``boxes``: a
    block held by several ranks (replicated) is encoded by one of them, taking turns by the
    tensor's ``index`` as a whole refit's holders do
    (:func:`~refit_worker.engine.planning.shard_plan.choose_holders`),
    so its changes are sent once."""
    return any(r == rank for r, _ in choose_holders(boxes, 0, index))


def global_index(index: torch.Tensor, block: BlockRef) -> torch.Tensor:
    """Flat indices within ``block`` (row-major over its size) as flat indices of the
    global tensor (``int64``)."""
    rest = index.to(torch.int64)
    if tuple(block.size[1:]) == tuple(block.shape[1:]):
        # A block of whole rows (FSDP2's dim-0 shards): one contiguous run of the tensor,
        # so an offset, not a division per dimension.
        return rest + block.offset[0] * math.prod(block.shape[1:]) if block.shape else rest
    out = torch.zeros_like(rest)
    stride = 1
    for dim in range(len(block.shape) - 1, -1, -1):
        size = block.size[dim]
        out += (rest % size + block.offset[dim]) * stride
        rest = rest // size
        stride *= block.shape[dim]
    return out


def block_view(tensor: torch.Tensor, block: BlockRef) -> torch.Tensor:
    """The elements of ``block`` in ``tensor`` (a view; not contiguous in general)."""
    return tensor[tuple(slice(o, o + s) for o, s in zip(block.offset, block.size, strict=True))]


def hash_block(tensor: torch.Tensor, algorithm: Algorithm) -> int:
    """The hash of a block's elements in row-major order (copied when not contiguous)."""
    return hash_bytes(as_bytes(tensor.contiguous()), algorithm)


def hash_blocks(
    local: Mapping[str, torch.Tensor], blocks: Mapping[str, BlockRef], algorithm: Algorithm
) -> list[BlockHash]:
    """The hashes of a rank's own blocks (``local[name]`` is the block ``blocks[name]`` of
    tensor ``name``); empty blocks hold nothing to check and are left out."""
    return [
        BlockHash(
            name=name,
            dtype=dtype_name(tensor.dtype),
            block=blocks[name],
            hash=hash_block(tensor, algorithm),
        )
        for name, tensor in local.items()
        if tensor.numel()
    ]


def blocks_digest(algorithm: Algorithm, hashes: Iterable[BlockHash]) -> str:
    """One digest of a sharded state from its blocks' hashes, in name and block order:
    ``<algorithm>/blocks:<16 hex digits>`` (a different form from a whole-tensor digest,
    so the two are never compared by mistake)."""
    lines = sorted(
        f"{h.name}|{h.dtype}|{list(h.block.shape)}|{list(h.block.offset)}|"
        f"{list(h.block.size)}|{h.hash:016x}"
        for h in hashes
    )
    return f"{algorithm}/blocks:{xxhash.xxh3_64_hexdigest(chr(10).join(lines).encode())}"


def merge_hashes(per_rank: Sequence[Sequence[BlockHash]]) -> tuple[BlockHash, ...]:
    """Every rank's block hashes as one list, a replicated block once.  Two holders of one
    block with different hashes are replicas that drifted apart: that raises, naming it."""
    found: dict[tuple[str, tuple[int, ...], tuple[int, ...]], BlockHash] = {}
    for hashes in per_rank:
        for h in hashes:
            key = (h.name, h.block.offset, h.block.size)
            before = found.get(key)
            if before is None:
                found[key] = h
            elif before != h:
                raise ValueError(
                    f"tensor {h.name!r}: two policy ranks hold block {h.block.offset}+"
                    f"{h.block.size} with different bytes (hash {before.hash:016x} and "
                    f"{h.hash:016x}); replicated weights must be equal on every rank"
                )
    return tuple(found[key] for key in sorted(found))


def check_blocks(blocks: Sequence[BlockHash], state: Mapping[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` unless ``blocks`` cover every element of every non-empty tensor
    of ``state`` exactly once (and name no other tensor, nor another dtype or shape)."""
    by_name: dict[str, list[Box]] = {}
    for h in blocks:
        tensor = state.get(h.name)
        if tensor is None:
            raise ValueError(f"the blocks name tensor {h.name!r}, which the state lacks")
        if h.dtype != dtype_name(tensor.dtype):
            raise ValueError(
                f"tensor {h.name!r}: the blocks are of {h.dtype}, the state holds "
                f"{dtype_name(tensor.dtype)}"
            )
        problem = place_block(by_name.setdefault(h.name, []), h.block, tensor.shape)
        if problem is not None:
            raise ValueError(f"tensor {h.name!r}: {problem}")
    for name, tensor in state.items():
        covered = sum(b.numel for b in by_name.get(name, []))
        if covered != tensor.numel():
            raise ValueError(
                f"tensor {name!r}: the blocks cover {covered} of its {tensor.numel()} elements"
            )


def state_blocks_digest(
    state: Mapping[str, torch.Tensor], blocks: Sequence[BlockHash], algorithm: Algorithm
) -> tuple[str, BlockHash | None]:
    """The :func:`blocks_digest` of ``state`` cut into ``blocks`` (checked to cover it,
    :func:`check_blocks`), and the first of ``blocks`` whose hash differs from the state's
    (None: every one matches)."""
    check_blocks(blocks, state)
    found: list[BlockHash] = []
    first: BlockHash | None = None
    for h in blocks:
        ours = h.model_copy(
            update={"hash": hash_block(block_view(state[h.name], h.block), algorithm)}
        )
        if first is None and ours.hash != h.hash:
            first = h
        found.append(ours)
    return blocks_digest(algorithm, found), first


def merge_pieces(
    pieces: Sequence[tuple[Sequence[DeltaEntry], int]],
) -> tuple[tuple[DeltaEntry, ...], tuple[int, ...], int]:
    """The ranks' delta pieces (entries, bytes), in rank order, laid end to end: the
    entries with their offsets in the whole, each piece's first byte, and the whole's
    bytes.  A piece's bytes are whole :data:`PIECE_ALIGN`-byte words (as
    :func:`~.codec.encode_delta` pads them), so the pieces cover the whole with no gap."""
    entries: list[DeltaEntry] = []
    starts: list[int] = []
    cursor = 0
    for rank, (piece_entries, nbytes) in enumerate(pieces):
        if nbytes % PIECE_ALIGN:
            raise ValueError(f"policy rank {rank}'s delta has {nbytes} bytes, not whole words")
        start = cursor
        starts.append(start)
        for entry in piece_entries:
            entries.append(
                entry.model_copy(
                    update={
                        "offset": entry.offset + start,
                        "values_offset": entry.values_offset + start,
                    }
                )
            )
        cursor = start + nbytes
    return tuple(entries), tuple(starts), cursor


__all__ = [
    "PIECE_ALIGN",
    "BlocksKey",
    "block_problem",
    "block_ref",
    "block_view",
    "blocks_digest",
    "blocks_key",
    "box_of",
    "check_blocks",
    "encoded_here",
    "global_index",
    "hash_block",
    "hash_blocks",
    "merge_hashes",
    "merge_pieces",
    "place_block",
    "state_blocks_digest",
]
