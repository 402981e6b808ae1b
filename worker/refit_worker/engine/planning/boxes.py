"""Pure box geometry of sharded tensors: who holds which block, and the contiguous runs.

A *box* is an axis-aligned block of a tensor in global coordinates (``offset`` and ``size``
per dimension).  A sharded parameter is a set of source boxes, one per holding rank; a
rollout rank wants a destination box (the whole tensor, or later a tensor-parallel slice).
Every box's elements are stored row-major and contiguous on the rank that holds it (a
DTensor's local shard, a rollout rank's landing tensor), so moving the intersection of a
source and a destination box is a list of *runs*: byte ranges contiguous on both sides.

* :func:`mesh_box`: the box a mesh coordinate holds under ``Shard(d)``/``Replicate``
  placements, with ``torch.chunk``'s rule for uneven sizes (511 rows over 2: 256 + 255),
  applied mesh dimension by mesh dimension as DTensor does;
* :func:`runs`: the runs of ``inner`` (inside both ``src`` and ``dst``): one run when the
  boxes differ only in the first dimension (``Shard(0)``), one per row for ``Shard(1)``.

Placements travel as plain tuples: ``("shard", dim)`` or ``("replicate",)``; anything else
(``_StridedShard``, ``Partial``) is the caller's to refuse.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

Placement = tuple[str] | tuple[str, int]


@dataclass(frozen=True, slots=True)
class Box:
    """A block of a tensor: ``size[d]`` entries of dimension ``d`` from ``offset[d]``."""

    offset: tuple[int, ...]
    size: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offset) != len(self.size):
            raise ValueError(f"box offset {self.offset} and size {self.size} differ in rank")
        if any(v < 0 for v in (*self.offset, *self.size)):
            raise ValueError(f"box offset {self.offset} / size {self.size} must be >= 0")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls(tuple(0 for _ in shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.size, strict=True))

    def within(self, other: Box) -> bool:
        """Whether every element of this box lies inside ``other``."""
        return all(
            o >= oo and e <= oe
            for o, e, oo, oe in zip(self.offset, self.end, other.offset, other.end, strict=True)
        )


def intersect(a: Box, b: Box) -> Box | None:
    """The common block of ``a`` and ``b`` (None when it holds no element)."""
    if len(a.size) != len(b.size):
        raise ValueError(f"boxes of rank {len(a.size)} and {len(b.size)} do not intersect")
    lo = tuple(max(x, y) for x, y in zip(a.offset, b.offset, strict=True))
    hi = tuple(min(x, y) for x, y in zip(a.end, b.end, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)) and lo:
        return None
    return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))


def chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(offset, length)`` of chunk ``index`` of ``size`` entries cut into ``parts``.

    ``torch.chunk``'s rule, which DTensor's ``Shard`` uses: every chunk but the last ones has
    ``ceil(size / parts)`` entries; trailing chunks may be short or empty.
    """
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"chunk {index} of {parts} does not exist")
    full = -(-size // parts)
    start = min(full * index, size)
    return start, min(size, start + full) - start


def mesh_box(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> Box:
    """The box that the rank at ``coordinate`` of the mesh holds (left-to-right sharding)."""
    if not len(mesh_shape) == len(placements) == len(coordinate):
        raise ValueError(
            f"mesh {tuple(mesh_shape)}, placements {tuple(placements)} and coordinate "
            f"{tuple(coordinate)} must have one entry per mesh dimension"
        )
    offset, size = [0] * len(shape), list(shape)
    for parts, placement, index in zip(mesh_shape, placements, coordinate, strict=True):
        if placement[0] == "replicate":
            continue
        if placement[0] != "shard" or len(placement) != 2:
            raise ValueError(f"placement {placement} is neither ('shard', dim) nor ('replicate',)")
        dim = placement[1]
        if not 0 <= dim < len(shape):
            raise ValueError(f"placement {placement} shards a dimension a {shape} tensor lacks")
        start, length = chunk(size[dim], parts, index)
        offset[dim] += start
        size[dim] = length
    return Box(tuple(offset), tuple(size))


def mesh_boxes(
    shape: Sequence[int],
    mesh_ranks: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
) -> list[tuple[int, Box]]:
    """``(rank, box)`` for every rank of the mesh; ``mesh_ranks`` flat, in row-major order."""
    if len(mesh_ranks) != math.prod(mesh_shape):
        raise ValueError(f"a {tuple(mesh_shape)} mesh lists {len(mesh_ranks)} ranks")
    coords = itertools.product(*(range(n) for n in mesh_shape))
    return [
        (rank, mesh_box(shape, mesh_shape, placements, coord))
        for rank, coord in zip(mesh_ranks, coords, strict=True)
    ]


def _strides(size: Sequence[int]) -> list[int]:
    strides, acc = [0] * len(size), 1
    for dim in range(len(size) - 1, -1, -1):
        strides[dim] = acc
        acc *= size[dim]
    return strides


Run = tuple[int, int, int]  # (source element offset, destination element offset, elements)


def runs(inner: Box, src: Box, dst: Box) -> list[Run]:
    """The runs (element offsets into ``src``'s and ``dst``'s own storage) covering ``inner``.

    ``inner`` must lie inside both.  Trailing dimensions that all three boxes span in full
    merge into one run; the dimensions before the first that differs are iterated.
    """
    if not (inner.within(src) and inner.within(dst)):
        raise ValueError(f"box {inner} is not inside both {src} and {dst}")
    if inner.numel == 0:
        return []
    ndim = len(inner.size)
    cut = ndim  # dims >= cut are spanned in full by all three boxes
    while cut > 0 and inner.size[cut - 1] == src.size[cut - 1] == dst.size[cut - 1]:
        cut -= 1
    # The run covers dimension `cut - 1` partly (or everything, when cut == 0).
    lead = max(cut - 1, 0)
    length = math.prod(inner.size[lead:])
    s_strides, d_strides = _strides(src.size), _strides(dst.size)
    found: list[Run] = []
    ranges = [range(inner.offset[d], inner.offset[d] + inner.size[d]) for d in range(lead)]
    start = list(inner.offset)
    for index in itertools.product(*ranges):
        start[:lead] = index
        s = sum((start[d] - src.offset[d]) * s_strides[d] for d in range(ndim))
        t = sum((start[d] - dst.offset[d]) * d_strides[d] for d in range(ndim))
        found.append((s, t, length))
    return found


__all__ = ["Box", "Placement", "Run", "chunk", "intersect", "mesh_box", "mesh_boxes", "runs"]
