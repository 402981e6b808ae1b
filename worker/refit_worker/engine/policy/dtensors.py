"""DTensor weights on a policy rank: its local shards and every rank's box, with no collective.

A trainer sharded with FSDP2 (``fully_shard``), tensor parallelism (``ColwiseParallel``,
``RowwiseParallel``) or both hands
:meth:`~refit_worker.engine.nixl.NIXLCheckpointEngine.send_weights` DTensor parameters.  Each policy
rank sends only the bytes of its own local shard (``to_local()``, never ``full_tensor()``), so the
receiver must know where each rank's block sits: that is computed here from the DTensor's own
metadata (global shape, device mesh, placements) for *every* rank of the mesh, locally, without
talking to any rank.

Supported placements: ``Shard(d)`` on any dimension and any number of mesh dimensions
(uneven sizes follow ``torch.chunk``, as DTensor does) and ``Replicate()``; a replicated
block, like a plain tensor (which every policy rank is taken to hold in full), is sent by
exactly one of its holders.  Refused, naming the parameter: ``_StridedShard`` (FSDP2 over
tensor parallelism on the same dimension interleaves the blocks; shard FSDP2 on another
dimension with ``fully_shard(..., shard_placement_fn=...)``) and ``Partial`` (a pending
reduction: reduce it first).

The mesh's ranks are taken as policy ranks: the trainer's ``torch.distributed`` ranks must
be the RefitJob's policy ranks (checked for this rank's own coordinate).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import torch

from ..base import dtype_name
from ..planning.boxes import Box, Placement, mesh_boxes
from ..planning.shard_plan import Holding

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

#: Only a process that loaded this module can hold a DTensor (it defines the class), so
#: ranks that never do (every rollout rank, plain trainers) skip its import: ~1 s of CPU
#: per process start, most of it sympy, paid by every worker on a 2-core machine.
_DTENSOR_MODULE = "torch.distributed.tensor"


@dataclass(frozen=True)
class ShardedSource:
    """One weight as this policy rank holds it: every rank's block, and its own."""

    held: Holding
    local: torch.Tensor  # this rank's block, contiguous, on the engine's device

    @property
    def local_nbytes(self) -> int:
        return self.local.numel() * self.local.element_size()


def is_sharded(weights: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """Whether any weight is a DTensor (the refit then goes by the shard plan)."""
    return any(_is_dtensor(tensor) for _, tensor in weights)


def _is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    module = sys.modules.get(_DTENSOR_MODULE)
    return module is not None and isinstance(tensor, module.DTensor)


def _placements(name: str, tensor: DTensor) -> list[Placement]:
    # Loaded already: ``tensor`` is a DTensor.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    found: list[Placement] = []
    for placement in tensor.placements:
        if isinstance(placement, _StridedShard):
            raise ValueError(
                f"weight {name!r} is a DTensor with placement _StridedShard(dim="
                f"{placement.dim}, split_factor={placement.split_factor}) on mesh "
                f"{tuple(tensor.device_mesh.shape)}: FSDP2 over tensor parallelism sharding "
                "the same dimension interleaves blocks, which kube-refit does not send; "
                "shard FSDP2 on another dimension (fully_shard(..., shard_placement_fn=...))"
            )
        if isinstance(placement, Shard):
            found.append(("shard", placement.dim))
        elif isinstance(placement, Replicate):
            found.append(("replicate",))
        else:
            raise ValueError(
                f"weight {name!r} is a DTensor with placement {type(placement).__name__} "
                f"({placement}): a pending "
                "reduction cannot be sent shard by shard; reduce it (redistribute) first"
            )
    return found


def _dtensor_source(
    name: str, tensor: DTensor, rank: int, world_size: int, device: torch.device
) -> ShardedSource:
    mesh = tensor.device_mesh
    shape = tuple(tensor.shape)
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if any(not 0 <= r < world_size for r in ranks):
        raise ValueError(
            f"weight {name!r}: its device mesh holds ranks {ranks}, but there are "
            f"{world_size} policy ranks; the trainer's ranks must be the policy ranks"
        )
    boxes = mesh_boxes(shape, ranks, tuple(mesh.shape), _placements(name, tensor))
    coordinate = mesh.get_coordinate()
    me = int(mesh.mesh[tuple(coordinate)].item()) if coordinate is not None else -1
    if me != rank:
        raise ValueError(
            f"weight {name!r}: this process is torch.distributed rank {me} of its mesh but "
            f"policy rank {rank}; the trainer's ranks must be the policy ranks"
        )
    local = tensor.to_local().detach()
    mine = next(box for r, box in boxes if r == rank)
    if tuple(local.shape) != mine.size:
        raise ValueError(
            f"weight {name!r}: the local shard has shape {tuple(local.shape)}, but its "
            f"placements {tensor.placements} give this rank the block {mine}"
        )
    held = Holding(name, dtype_name(local.dtype), shape, tuple(boxes))
    return ShardedSource(held, _on(local, device))


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device.type != device.type:
        tensor = tensor.to(device)
    return tensor.contiguous()


def local_sources(
    weights: Sequence[tuple[str, torch.Tensor]],
    *,
    rank: int,
    world_size: int,
    device: torch.device,
) -> list[ShardedSource]:
    """Every weight as a :class:`ShardedSource`; plain tensors are held in full by all."""
    found = []
    for name, tensor in weights:
        if not isinstance(name, str) or not name:
            raise ValueError(f"weight names must be non-empty strings, got {name!r}")
        if _is_dtensor(tensor):
            found.append(_dtensor_source(name, tensor, rank, world_size, device))
        elif isinstance(tensor, torch.Tensor):
            whole = Box.whole(tuple(tensor.shape))
            boxes = tuple((r, whole) for r in range(world_size))
            held = Holding(name, dtype_name(tensor.dtype), tuple(tensor.shape), boxes)
            found.append(ShardedSource(held, _on(tensor.detach(), device)))
        else:
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor")
    return found


__all__ = ["ShardedSource", "is_sharded", "local_sources"]
