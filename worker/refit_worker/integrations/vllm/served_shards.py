"""A tensor-parallel vLLM worker's part of the checkpoint, read from vLLM's own layers.

Each parallel layer carries its ``tp_rank`` / ``tp_size`` and its sizes (a merged
column's ``output_sizes``, q/k/v's head counts and ``num_kv_head_replicas``, a row's
``input_size``, an embedding's ``shard_indices``), and its parameters say which dimension
is split (``output_dim`` / ``input_dim``).  :func:`layer_shardings` turns those into the
pure description of :mod:`.tp_slices`; :func:`declaration` maps every checkpoint tensor
onto its layer with the model's own name mapping and declares the part this worker holds.

Fused MoE experts without expert parallelism (unquantized, the kind the read-back
reproduces) are split by each expert's intermediate rows: the checkpoint's per-expert
tensors (``<layer>.<e>.gate_proj.weight`` ...) are declared part by part.  A layer of any
other kind that holds parameters of its own and no quant method (norms) is held whole;
anything else (quantized layers, expert-parallel experts) is not described: its
tensors are sent whole and vLLM's loader takes its part, as before, and the read-back
names it ``unprobed`` above one rank.

Runs inside a vLLM process; vLLM is imported inside its functions.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from refit_worker.integrations.vllm.served import readable_experts, served_name, shard_index
from refit_worker.integrations.vllm.tp_slices import Part, Served, Sharding, declare


def _dim(module: Any, attr: str, default: int) -> int:
    param = getattr(module, "weight", None)
    value = getattr(param, attr, None)
    return int(value) if value is not None else default


def _column(module: Any) -> Sharding:
    from vllm.model_executor.layers.linear import QKVParallelLinear

    rank, size = int(module.tp_rank), int(module.tp_size)
    dim = _dim(module, "output_dim", 0)
    local = sum(int(s) for s in module.output_partition_sizes)
    if isinstance(module, QKVParallelLinear):
        kv = int(module.total_num_kv_heads)
        replicas = int(module.num_kv_head_replicas)
        sizes: tuple[int, ...] = (
            int(module.total_num_heads) * int(module.head_size),
            kv * int(module.head_size),
            kv * int(module.v_head_size),
        )
        return Sharding(
            "column", dim, rank, size, sizes=sizes, replicas=(1, replicas, replicas), local=local
        )
    sizes = tuple(int(s) for s in getattr(module, "output_sizes", None) or [module.output_size])
    return Sharding("column", dim, rank, size, sizes=sizes, local=local)


def sharding_of(module: torch.nn.Module) -> Sharding | None:
    """How vLLM split ``module`` (None: a kind this reader does not describe)."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    m: Any = module
    if isinstance(m, ColumnParallelLinear):
        return _column(m)
    if isinstance(m, RowParallelLinear):
        dim, local = _dim(m, "input_dim", 1), int(m.input_size_per_partition)
        sizes = (int(m.input_size),)
        return Sharding("row", dim, int(m.tp_rank), int(m.tp_size), sizes=sizes, local=local)
    if isinstance(m, VocabParallelEmbedding):
        rows = (
            int(m.shard_indices.org_vocab_start_index),
            int(m.shard_indices.org_vocab_end_index),
        )
        dim, local = _dim(m, "output_dim", 0), int(m.num_embeddings_per_partition)
        return Sharding("vocab", dim, int(m.tp_rank), int(m.tp_size), rows=rows, local=local)
    if readable_experts(m):
        config = m.moe_config
        rank, size = int(config.tp_rank), int(config.moe_parallel_config.tp_size)
        local = int(m.intermediate_size_per_partition)
        return Sharding("experts", 0, rank, size, sizes=(local * size,), local=local)
    if isinstance(m, ReplicatedLinear) or getattr(m, "quant_method", None) is None:
        return Sharding("whole")
    return None


#: A checkpoint tensor of one expert under its layer: ``<e>.<proj>.weight``.
_EXPERT = re.compile(r"(?P<expert>\d+)\.(?P<proj>[^.]+)\.weight")


def _expert_served(name: str, experts: Mapping[str, tuple[str, Any]]) -> Served | None:
    """Where a per-expert checkpoint tensor lands: its layer's fused ``w13`` / ``w2``."""
    for layer, (module_name, module) in experts.items():
        if not name.startswith(layer + "."):
            continue
        match = _EXPERT.fullmatch(name[len(layer) + 1 :])
        if match is None:
            return None
        return Served(module_name, "w2" if match["proj"] == module.ckpt_down_proj_name else "w13")
    return None


def layer_shardings(model: torch.nn.Module) -> dict[str, Sharding]:
    """Every layer with parameters of its own that this reader describes, by name."""
    found = {}
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is None:
            continue
        sharding = sharding_of(module)
        if sharding is not None:
            found[name] = sharding
    return found


def served_layers(model: torch.nn.Module, names: Iterable[str]) -> dict[str, Served | None]:
    """Each checkpoint tensor's layer, parameter and stacked part, by the model's mapping."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    stacked = getattr(mapper, "orig_to_new_stacked", {})
    to_served = served_name(model)
    experts = {  # fused-experts layers by the prefix of their checkpoint names
        str(m.layer_name): (n, m)
        for n, m in model.named_modules()
        if hasattr(m, "ckpt_down_proj_name")
    }
    out: dict[str, Served | None] = {}
    for name in names:
        expert = _expert_served(name, experts)
        if expert is not None:
            out[name] = expert
            continue
        param = to_served(name)
        if param is None or "." not in param:
            out[name] = None
            continue
        layer, _, attr = param.rpartition(".")
        out[name] = Served(layer, attr, shard_index(name, stacked))
    return out


@dataclass(frozen=True)
class Declaration:
    """What one worker holds: the declared parts, and the layers whose every tensor is
    described (the read-back can probe those from the parts alone)."""

    tp_rank: int
    tp_size: int
    parts: dict[str, Part]
    described: frozenset[str]


def declaration(model: torch.nn.Module, names: Iterable[str], tp_size: int) -> Declaration:
    """This worker's part of each of the checkpoint tensors ``names``."""
    from vllm.distributed import get_tensor_model_parallel_rank

    layers = layer_shardings(model)
    served = served_layers(model, names)
    rank = int(get_tensor_model_parallel_rank()) if tp_size > 1 else 0
    return Declaration(rank, tp_size, declare(served, layers), frozenset(layers))
