"""One vLLM worker's refit session, tensor parallelism included.

With ``tensor_parallel_size`` above 1 each vLLM worker is a rollout rank of its own: the
rank in the environment is its replica's first, and the worker adds its tensor-parallel
rank (so a job's rollout world size counts workers).  It declares the part of every
checkpoint tensor it serves (:mod:`.served_shards`, read from vLLM's own layers) in its
metadata, and the policy sends it only those bytes.  The landing goes through vLLM's own
loader: each received part is placed at its offset in an uninitialised tensor of the
checkpoint's shape (host memory the loader never reads outside the part: it narrows to
the same rows or columns), so every parameter is filled by its own ``weight_loader``; the
read-back then checks each layer's local part through this worker's kernels.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from refit_worker.contract.config import ConfigError, WorkerConfig
from refit_worker.engine import TargetWeightLayout
from refit_worker.integrations.staged import StagedReceiver, stop_flag
from refit_worker.integrations.vllm.landing import (
    Layout,
    RefitLanding,
    served_checkpoint,
    vllm_landing,
)
from refit_worker.integrations.vllm.served_shards import Declaration, declaration
from refit_worker.integrations.vllm.tp_slices import local_shape
from refit_worker.rollout.rollout_session import RolloutSession


@dataclass(frozen=True)
class WorkerPart:
    """What one tensor-parallel worker holds of the checkpoint (``full``: its shapes)."""

    held: Declaration
    full: Layout

    @property
    def layout(self) -> TargetWeightLayout:
        """The declaration as it travels in the rank's metadata."""
        held = self.held
        return TargetWeightLayout(tp_rank=held.tp_rank, tp_size=held.tp_size, slices=held.parts)

    def local(self) -> Layout:
        """``name -> shape`` of what this worker receives (the layout check's reference)."""
        return {n: local_shape(shape, self.held.parts.get(n)) for n, shape in self.full.items()}

    def widen(self, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """Each received part at its place in a tensor of the checkpoint's shape, for
        vLLM's loader (which reads only that part of it); whole tensors as they are.
        Lazy: each full-shaped tensor is made when the loader asks for it, so a landing
        never holds the whole model in that shape at once."""
        return _Widened(weights, self)


class _Widened(Mapping[str, torch.Tensor]):
    """:meth:`WorkerPart.widen`'s view: made per item, never kept."""

    def __init__(self, weights: Mapping[str, torch.Tensor], part: WorkerPart) -> None:
        self._weights, self._part = weights, part

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._weights[name]
        part = self._part.held.parts.get(name)
        if part is None or name not in self._part.full:
            return tensor
        dim, start, stop = part
        full = torch.empty(self._part.full[name], dtype=tensor.dtype, device=tensor.device)
        full.narrow(dim, start, stop - start).copy_(tensor)
        return full

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


def worker_part(vllm_config: Any, model: torch.nn.Module, full: Layout | None) -> WorkerPart | None:
    """This worker's part (None: one rank, or no local checkpoint to name the tensors)."""
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    if tp_size == 1 or full is None:
        return None
    return WorkerPart(declaration(model, full.keys(), tp_size), full)


def open_landing(
    vllm_config: Any,
    get_model: Callable[[], Any],
    reload: Callable[[Mapping[str, Any]], None],
    env: Mapping[str, str] | None,
) -> RefitLanding:
    """The rollout session of this worker (its rank and part) and its landing in vLLM."""
    config = WorkerConfig.from_env(env if env else os.environ)
    checkpoint = served_checkpoint(vllm_config.model_config.model)
    part = worker_part(vllm_config, get_model(), checkpoint["served"])
    layout, widen, described = None, None, frozenset[str]()
    if int(vllm_config.parallel_config.tensor_parallel_size) > 1:
        # Its own rank even with nothing declared (a hub id: full tensors, as before).
        config = _worker_rank(config, _tp_rank())
    if part is not None:
        checkpoint["served"], layout = part.local(), part.layout
        widen, described = part.widen, part.held.described
    parts = vllm_landing(vllm_config, get_model, reload, widen, described)
    session = RolloutSession(config, stop_requested=stop_flag(config), target_layout=layout)
    return RefitLanding(StagedReceiver(session), **checkpoint, **parts)


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _worker_rank(config: WorkerConfig, tp_rank: int) -> WorkerConfig:
    """The rank of tensor-parallel worker ``tp_rank`` of the replica whose first rank the
    environment names."""
    rank = config.rank + tp_rank
    if rank >= config.rollout_world_size:
        raise ConfigError(
            f"REFIT_RANK {config.rank} + tensor-parallel rank {tp_rank} is outside the "
            f"rollout world size {config.rollout_world_size}: with tensor parallelism each "
            "vLLM worker is a rollout rank (the world size counts workers, and a replica's "
            "REFIT_RANK is its first worker's)"
        )
    return config.model_copy(update={"rank": rank})
