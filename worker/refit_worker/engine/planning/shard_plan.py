"""Pure plan of a sharded refit: source boxes x destination boxes, bucketed per sender.

Input, per tensor, a :class:`ShardSpec`: the destination box one rollout rank lands (its
``shape`` at ``offset`` in the global tensor; the whole tensor today) and the source boxes,
each held by exactly one policy rank (the manifest carries them; replicated boxes were
already given to one holder, see :func:`choose_holders`).  Output: a
:class:`~.buckets.Plan` whose buckets each have one sender (``Plan.senders``) and whose
pieces are :class:`ShardMeta`: ``chunk_offset`` is the byte offset in the destination
tensor, ``source_offset`` the byte offset in the sender's local shard.  Every piece lands
in the destination's memory (no receive buffer), so a bucket only bounds one WRITE: at most
``bucket_size`` bytes and :data:`MAX_PIECES` descriptors (a ``Shard(1)`` parameter is one
piece per row).

Checked before anything moves: the source boxes lie inside the tensor, never overlap, and
cover the destination box exactly, so every byte crosses the wire once.  A zero-size tensor
still gets a zero-byte piece, so it arrives.

Every rank computes the same plan from the same manifest: the senders each pick their own
buckets out of it, the receiver checks it against the sender's digest.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import Field

from ..base import TensorMeta
from .boxes import Box, intersect, runs
from .buckets import Plan, TensorSpec, check_bucket_size, check_unique_names
from .layout import WHOLE, TargetWeightLayout, select_slice

#: Descriptors in one bucket's WRITE (and hashes in its digest message) at most.
MAX_PIECES = 512


@dataclass(frozen=True, slots=True)
class ShardSpec(TensorSpec):
    """A destination tensor (``shape`` at ``offset`` of the global tensor) and its sources."""

    offset: tuple[int, ...] = ()
    #: ``(policy rank, box in global coordinates)`` for every block that must be sent.
    sources: tuple[tuple[int, Box], ...] = ()

    @property
    def dest(self) -> Box:
        return Box(self.offset or tuple(0 for _ in self.shape), self.shape)


class ShardMeta(TensorMeta):
    """A piece of a sharded refit: ``chunk_size`` bytes from ``source``'s local shard."""

    source: int = Field(ge=0)
    source_offset: int = Field(ge=0)


def choose_holders(
    boxes: Sequence[tuple[int, Box]], receiver: int, index: int
) -> tuple[tuple[int, Box], ...]:
    """One holder per distinct box (replicas hold the same box): sent by exactly one rank.

    Holders take turns by ``index + receiver`` (e.g. the tensor's position in the model),
    so replicated tensors spread over the policy ranks, and over receivers.  Empty boxes
    are dropped.
    """
    holders: dict[Box, list[int]] = {}
    for rank, box in boxes:
        if box.numel:
            holders.setdefault(box, []).append(rank)
    return tuple(
        (sorted(ranks)[(index + receiver) % len(ranks)], box) for box, ranks in holders.items()
    )


@dataclass(frozen=True)
class Holding:
    """Who holds which block of one weight (global ``shape``), replicas included."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    boxes: tuple[tuple[int, Box], ...]  # (policy rank, box)


def receiver_specs(
    held: Sequence[Holding], receiver: int, layout: TargetWeightLayout | None
) -> list[ShardSpec]:
    """What rollout rank ``receiver`` gets: its destination box of each weight (the whole
    tensor, or the slice its layout names) and one holder per source block inside it."""
    specs = []
    for index, weight in enumerate(held):
        part = select_slice(weight.name, weight.shape, layout)
        if part is None:
            continue
        offset, shape = [0] * len(weight.shape), list(weight.shape)
        if part != WHOLE:
            offset[part.dim], shape[part.dim] = part.start, part.length
        dest = Box(tuple(offset), tuple(shape))
        wanted = tuple(
            (rank, box)
            for rank, box in choose_holders(weight.boxes, receiver, index)
            if intersect(box, dest) is not None
        )
        specs.append(
            ShardSpec(weight.name, weight.dtype, dest.size, offset=dest.offset, sources=wanted)
        )
    return specs


def check_cover(spec: ShardSpec, global_shape: Sequence[int] | None = None) -> None:
    """Raise naming the tensor unless its sources cover its destination exactly once."""
    dest = spec.dest
    boxes = [box for _, box in spec.sources]
    for rank, box in spec.sources:
        if len(box.size) != len(spec.shape):
            raise ValueError(f"{spec.name!r}: rank {rank}'s box {box} has the wrong rank")
        if global_shape is not None and not box.within(Box.whole(global_shape)):
            raise ValueError(f"{spec.name!r}: rank {rank}'s box {box} lies outside the tensor")
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            common = intersect(a, b)
            if common is not None and common.numel:
                raise ValueError(
                    f"{spec.name!r}: source boxes {a} and {b} overlap: a byte would be sent twice"
                )
    covered = sum(common.numel for b in boxes if (common := intersect(b, dest)) is not None)
    if covered != dest.numel:
        raise ValueError(
            f"{spec.name!r}: the source boxes cover {covered} of the {dest.numel} elements "
            f"of the destination {dest}"
        )


def _pieces(spec: ShardSpec, bucket_size: int) -> list[tuple[int, int, int, int]]:
    """``(sender, source byte offset, destination byte offset, bytes)``, cut to fit buckets."""
    item, dest = spec.itemsize, spec.dest
    cap = bucket_size // item * item
    found = []
    for rank, box in spec.sources:
        common = intersect(box, dest)
        if common is None:
            continue
        for src, dst, count in runs(common, box, dest):
            done, total = 0, count * item
            while done < total:
                take = min(cap, total - done)
                found.append((rank, src * item + done, dst * item + done, take))
                done += take
    if not found and math.prod(spec.shape) == 0:
        first = min((rank for rank, _ in spec.sources), default=0)
        found.append((first, 0, 0, 0))  # a zero-size tensor still arrives
    return found


def plan_shards(specs: Sequence[ShardSpec], bucket_size: int) -> Plan:
    """Plan a sharded refit (see the module docstring)."""
    check_bucket_size(bucket_size, specs)
    check_unique_names([spec.name for spec in specs])
    per_sender: dict[int, list[list[ShardMeta]]] = {}
    fill: dict[int, int] = {}
    for spec in specs:
        check_cover(spec)
        for rank, src, dst, size in _pieces(spec, bucket_size):
            buckets = per_sender.setdefault(rank, [[]])
            used = fill.get(rank, 0)
            if buckets[-1] and (used + size > bucket_size or len(buckets[-1]) >= MAX_PIECES):
                buckets.append([])
                used = 0
            buckets[-1].append(
                ShardMeta(
                    name=spec.name,
                    shape=spec.shape,
                    dtype=spec.dtype,
                    chunk_offset=dst,
                    chunk_size=size,
                    offset=used,
                    source=rank,
                    source_offset=src,
                )
            )
            fill[rank] = used + size
    # Senders take turns bucket by bucket, so the receiver hashes what several send at once.
    order: list[tuple[int, tuple[ShardMeta, ...]]] = []
    queues = {rank: list(buckets) for rank, buckets in sorted(per_sender.items())}
    while any(queues.values()):
        for rank, queue in queues.items():
            if queue:
                order.append((rank, tuple(queue.pop(0))))
    if not order:
        order.append((0, ()))  # an empty refit still has one (empty) bucket
    return Plan(
        digest=shard_digest(specs, bucket_size),
        bucket_size=bucket_size,
        specs=tuple(specs),
        buckets=tuple(bucket for _, bucket in order),
        senders=tuple(rank for rank, _ in order),
    )


def shard_digest(specs: Sequence[ShardSpec], bucket_size: int) -> str:
    """A digest of a sharded plan's inputs: every sender and the receiver must agree on it."""
    text = json.dumps(
        [
            "shards",
            bucket_size,
            MAX_PIECES,
            [
                [
                    s.name,
                    s.dtype,
                    list(s.shape),
                    list(s.dest.offset),
                    [[r, list(b.offset), list(b.size)] for r, b in s.sources],
                ]
                for s in specs
            ],
        ],
        separators=(",", ":"),
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


_PLANS: dict[tuple[tuple[ShardSpec, ...], int], Plan] = {}
_PLAN_CACHE_SIZE = 8


def cached_shard_plan(specs: Sequence[ShardSpec], bucket_size: int) -> Plan:
    """:func:`plan_shards` memoised by its inputs (a layout that stays is planned once)."""
    key = (tuple(specs), bucket_size)
    plan = _PLANS.get(key)
    if plan is None:
        plan = plan_shards(key[0], bucket_size)
        if len(_PLANS) >= _PLAN_CACHE_SIZE:
            del _PLANS[next(iter(_PLANS))]
        _PLANS[key] = plan
    return plan


def source_offset(piece: TensorMeta) -> int:
    """Where a piece's bytes start in the sender's tensor (its local shard when sharded)."""
    return piece.source_offset if isinstance(piece, ShardMeta) else piece.chunk_offset


__all__ = [
    "MAX_PIECES",
    "Holding",
    "ShardMeta",
    "ShardSpec",
    "cached_shard_plan",
    "check_cover",
    "choose_holders",
    "plan_shards",
    "receiver_specs",
    "shard_digest",
    "source_offset",
]
