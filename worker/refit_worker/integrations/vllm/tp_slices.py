"""Which part of each checkpoint tensor one tensor-parallel vLLM worker holds.

vLLM splits a layer by its class: a column-parallel linear along its output rows (each
stacked part, q/k/v or gate/up, split on its own; the k/v heads replicated over ranks when
there are fewer of them than ranks), a row-parallel linear along its input columns (its
bias whole), a vocabulary-parallel embedding or LM head along its rows (the vocabulary is
padded first, so the last rank may hold fewer real rows), everything else whole.  The
worker reads that from vLLM's own layer objects (:mod:`.served_shards`); here, from such a
description, the declaration: checkpoint name -> ``(dim, start, stop)``, the rows or
columns of the checkpoint tensor the worker serves (fused MoE experts without expert
parallelism: each expert's intermediate rows, :func:`part_of`).  A tensor that is held whole is not
declared (the sender sends it whole).

Pure: a contract in pyproject.toml keeps vLLM and torch out, so it is tested on a made-up
description as well as used on the real model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

#: ``(dim, start, stop)`` of a checkpoint tensor.
Part = tuple[int, int, int]
Kind = Literal["column", "row", "vocab", "experts", "whole"]


@dataclass(frozen=True)
class Sharding:
    """How one vLLM layer splits the checkpoint tensors it serves over ``tp_size`` ranks.

    ``column``: ``sizes`` is the global output size of each stacked part in shard order
    and ``replicas`` how many ranks share each part (k/v heads fewer than ranks), 1 each
    when empty.  ``row``: ``sizes`` is the global input size.  ``vocab``: ``rows`` are
    the real vocabulary rows this rank holds (padding excluded).  ``experts``: ``sizes``
    is the global intermediate size; each expert's gate and up tensors are split along
    their rows, its down tensor along its columns (``w2``)."""

    kind: Kind
    #: The dimension of the parameter that is split (vLLM's ``output_dim`` / ``input_dim``).
    dim: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    sizes: tuple[int, ...] = ()
    replicas: tuple[int, ...] = ()
    rows: tuple[int, int] = (0, 0)
    #: vLLM's own size of this rank's part along ``dim`` (its ``*_per_partition``), which
    #: the parts must add up to (0: not known, not checked).
    local: int = 0


@dataclass(frozen=True)
class Served:
    """Where one checkpoint tensor lands: the layer, the parameter (``weight``,
    ``bias``...) and, for a stacked layer, which of its parts (0 otherwise)."""

    layer: str
    attr: str
    part: int = 0


def _column(sharding: Sharding, part: int, name: str) -> Part:
    if part >= len(sharding.sizes):
        raise ValueError(f"{name!r} is part {part} of a layer of {len(sharding.sizes)} parts")
    replicas = sharding.replicas[part] if sharding.replicas else 1
    holders = sharding.tp_size // replicas  # distinct pieces of this part
    size = sharding.sizes[part]
    if holders < 1 or sharding.tp_size % replicas or size % holders:
        raise ValueError(
            f"{name!r}: {size} rows do not split over {sharding.tp_size} ranks with "
            f"{replicas} replicas each"
        )
    length = size // holders
    start = (sharding.tp_rank // replicas) * length
    return (sharding.dim, start, start + length)


def _row(sharding: Sharding, name: str) -> Part:
    size = sharding.sizes[0] if sharding.sizes else 0
    if size % sharding.tp_size:
        raise ValueError(f"{name!r}: {size} columns do not split over {sharding.tp_size} ranks")
    length = size // sharding.tp_size
    return (sharding.dim, sharding.tp_rank * length, (sharding.tp_rank + 1) * length)


def part_of(name: str, served: Served, sharding: Sharding) -> Part | None:
    """The part of checkpoint tensor ``name`` its layer holds on this rank (None: whole)."""
    if sharding.tp_size == 1 or sharding.kind == "whole":
        return None
    if sharding.kind == "column":
        return _column(sharding, served.part, name)
    if sharding.kind == "experts":
        # Per expert: gate / up are column-parallel (rows), down is row-parallel (columns).
        split = Sharding("row", 1, sharding.tp_rank, sharding.tp_size, sharding.sizes)
        if served.attr == "w2":
            return _row(split, name)
        return _column(replace(split, kind="column", dim=0), 0, name)
    if sharding.kind == "row":
        # The bias of a row-parallel layer is added once, after the reduction: held whole.
        return _row(sharding, name) if served.attr == "weight" else None
    start, stop = sharding.rows
    return (sharding.dim, start, stop)


def _held(sharding: Sharding, layer: str) -> int:
    """How much of ``dim`` this rank's parts take, by the description's arithmetic."""
    if sharding.kind == "column":
        parts = range(len(sharding.sizes))
        return sum(_column(sharding, p, layer)[2] - _column(sharding, p, layer)[1] for p in parts)
    if sharding.kind == "vocab":
        return sharding.rows[1] - sharding.rows[0]
    _, start, stop = _row(replace(sharding, kind="row"), layer)
    return stop - start


def check_layer(layer: str, sharding: Sharding) -> None:
    """Raise unless the parts the description implies fill what vLLM allocated on this
    rank (a padded vocabulary: at most that)."""
    if sharding.local <= 0 or sharding.tp_size == 1 or sharding.kind == "whole":
        return
    held = _held(sharding, layer)
    fits = held <= sharding.local if sharding.kind == "vocab" else held == sharding.local
    if not fits:
        raise ValueError(
            f"layer {layer!r}: its {sharding.kind} parts take {held} along dimension "
            f"{sharding.dim}, vLLM holds {sharding.local} on rank {sharding.tp_rank}: the "
            "description does not match the engine's sharding"
        )


def declare(served: Mapping[str, Served | None], layers: Mapping[str, Sharding]) -> dict[str, Part]:
    """Checkpoint name -> the part this rank holds, for every tensor held in part.

    ``served``: each checkpoint tensor's layer (None: the engine does not serve it, or it
    lands where no sharding is known: sent whole, and vLLM's loader takes its part)."""
    for layer, sharding in layers.items():
        check_layer(layer, sharding)
    declared: dict[str, Part] = {}
    for name, where in served.items():
        if where is None or where.layer not in layers:
            continue
        part = part_of(name, where, layers[where.layer])
        if part is not None:
            declared[name] = part
    return declared


def local_shape(shape: tuple[int, ...], part: Part | None) -> tuple[int, ...]:
    """The shape of the part of a tensor of ``shape`` a rank holds."""
    if part is None:
        return shape
    dim, start, stop = part
    return (*shape[:dim], stop - start, *shape[dim + 1 :])


__all__ = ["Part", "Served", "Sharding", "check_layer", "declare", "local_shape", "part_of"]
