"""Pure bucket planning: which bytes of which tensor go where in which bucket.

:func:`plan_buckets` turns an ordered list of :class:`TensorSpec` into buckets of
:class:`~refit_worker.engine.base.TensorMeta` pieces before any byte moves.  Rules, in order:

* every piece starts at an offset aligned to its element size, so the receiver can view
  the bucket bytes as the tensor's dtype without copying;
* a tensor that fits in the rest of the current bucket goes there; one that fits in an
  empty bucket opens a new bucket (never split needlessly);
* a tensor larger than a bucket is cut into chunks whose sizes are whole elements,
  filling the current bucket first, then whole buckets;
* a zero-size tensor still gets a (zero-byte) piece, so it arrives;
* duplicate names are an error before anything is sent.

An empty input plans one empty bucket, so a receiver always gets a message.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..base import TensorMeta, element_size
from .mapping import bucket_sender

Bucket = list[TensorMeta]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What the planner needs of one tensor: its name, wire dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return element_size(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return math.prod(self.shape) * self.itemsize


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def check_bucket_size(bucket_size: object, specs: Sequence[TensorSpec] = ()) -> int:
    """Validate ``bucket_size``: a positive int at least as large as every element size."""
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int):
        raise TypeError(f"bucket_size must be an int number of bytes, got {bucket_size!r}")
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be > 0 bytes, got {bucket_size}")
    widest = max((spec.itemsize for spec in specs), default=1)
    if bucket_size < widest:
        raise ValueError(f"bucket_size {bucket_size} is smaller than one element ({widest} bytes)")
    return bucket_size


def check_unique_names(names: Sequence[str]) -> None:
    """Raise ``ValueError`` naming every name that occurs more than once."""
    dupes = sorted(name for name, count in Counter(names).items() if count > 1)
    if dupes:
        raise ValueError(f"duplicate tensor names: {dupes}")


def plan_buckets(specs: Sequence[TensorSpec], bucket_size: int) -> list[Bucket]:
    """Plan the buckets for ``specs`` (in order) with ``bucket_size`` bytes each."""
    check_bucket_size(bucket_size, specs)
    check_unique_names([spec.name for spec in specs])
    buckets: list[Bucket] = []
    current: Bucket = []
    cursor = 0

    def close() -> None:
        nonlocal current, cursor
        if current:
            buckets.append(current)
        current, cursor = [], 0

    for spec in specs:
        size, item = spec.nbytes, spec.itemsize
        offset = _align(cursor, item)
        if offset + size > bucket_size and size <= bucket_size:
            close()
            offset = 0
        if size <= bucket_size:
            current.append(_piece(spec, 0, size, offset))
            cursor = offset + size
            continue
        done = 0
        while done < size:
            offset = _align(cursor, item)
            room = (bucket_size - offset) // item * item if offset < bucket_size else 0
            if room <= 0:
                close()
                continue
            take = min(room, size - done)
            current.append(_piece(spec, done, take, offset))
            done += take
            cursor = offset + take
    close()
    return buckets or [[]]


def _piece(spec: TensorSpec, chunk_offset: int, chunk_size: int, offset: int) -> TensorMeta:
    return TensorMeta(
        name=spec.name,
        shape=spec.shape,
        dtype=spec.dtype,
        chunk_offset=chunk_offset,
        chunk_size=chunk_size,
        offset=offset,
    )


def plan_digest(specs: Sequence[TensorSpec], bucket_size: int) -> str:
    """A digest of the inputs of a plan; senders striping one receiver must agree on it."""
    text = json.dumps(
        [bucket_size, [[s.name, s.dtype, list(s.shape)] for s in specs]], separators=(",", ":")
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Plan:
    """A cached plan: its digest and its buckets (read-only; shared between refits)."""

    digest: str
    bucket_size: int
    specs: tuple[TensorSpec, ...]
    buckets: tuple[tuple[TensorMeta, ...], ...]
    #: The policy rank that sends each bucket (a sharded plan, :mod:`.shard_plan`); None:
    #: identical senders take turns (:func:`~.mapping.bucket_sender`).
    senders: tuple[int, ...] | None = None

    def sender(self, seq: int, sources: tuple[int, ...]) -> int:
        """The policy rank that sends bucket ``seq`` (``sources``: the receiver's, in turn)."""
        if self.senders is not None:
            return self.senders[seq]
        return bucket_sender(seq, sources)


_PLANS: dict[tuple[tuple[TensorSpec, ...], int], Plan] = {}
_PLAN_CACHE_SIZE = 8


def cached_plan(specs: Sequence[TensorSpec], bucket_size: int) -> Plan:
    """:func:`plan_buckets` memoised by its inputs: a layout that does not change between
    refits is planned once (the last few layouts are kept)."""
    key = (tuple(specs), bucket_size)
    plan = _PLANS.get(key)
    if plan is None:
        buckets = plan_buckets(key[0], bucket_size)
        plan = Plan(
            plan_digest(key[0], bucket_size), bucket_size, key[0], tuple(map(tuple, buckets))
        )
        if len(_PLANS) >= _PLAN_CACHE_SIZE:
            del _PLANS[next(iter(_PLANS))]
        _PLANS[key] = plan
    return plan


def lands(piece: TensorMeta, landing: Mapping[str, int]) -> bool:
    """Whether ``piece`` goes straight into landing memory (``landing``: name -> nbytes).

    Both sides decide it with this function from the same plan and landing set, so they
    agree on which buckets need a receive buffer without saying so on the wire.
    """
    return piece.chunk_size > 0 and landing.get(piece.name) == piece.nbytes


def buffer_slots(
    buckets: Sequence[Sequence[TensorMeta]], landing: Mapping[str, int], buffer_count: int
) -> list[int]:
    """Per bucket: the receive buffer it uses, or -1 when all of its bytes land.

    Buckets that need a buffer take the buffers in turn (the j-th such bucket uses buffer
    ``j % buffer_count``), so a refit that lands everything needs no buffer and no credit.
    """
    if buffer_count < 1:
        raise ValueError(f"buffer_count must be >= 1, got {buffer_count}")
    slots: list[int] = []
    used = 0
    for bucket in buckets:
        if all(piece.chunk_size == 0 or lands(piece, landing) for piece in bucket):
            slots.append(-1)
        else:
            slots.append(used % buffer_count)
            used += 1
    return slots


def buffer_handoffs(slots: Sequence[int], buffer_count: int) -> tuple[list[int], dict[int, int]]:
    """Credits for buffered buckets: the ones credited up front, and ``{earlier: later}``.

    The first ``buffer_count`` buckets that use a buffer are credited at once; every later
    one is credited when the receiver is done with the previous bucket in the same buffer.
    """
    buffered = [seq for seq, slot in enumerate(slots) if slot >= 0]
    handoffs = {buffered[j - buffer_count]: buffered[j] for j in range(buffer_count, len(buffered))}
    return buffered[:buffer_count], handoffs
