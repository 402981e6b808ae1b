"""The synthetic model's layout: names, shapes and size, computed without building it.

The worker generates the tensors (``refit_worker.weights``); the operator's local runner
sizes a job from the same layout before it starts a process, so both read it here.

Must not import: anything but the standard library and ``refit_worker.contract`` (torch in
particular).
"""

from __future__ import annotations

from math import prod

from refit_worker.contract.config import SyntheticWeights
from refit_worker.contract.dtypes import WireDtype

#: Bytes per element of each wire dtype (what ``torch.empty((), dtype=d).element_size()``
#: says; ``tests/unit/test_weights.py`` checks the two agree).
ITEMSIZE: dict[WireDtype, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def synthetic_shapes(spec: SyntheticWeights) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the synthetic model, in a fixed order (a Llama-like layout)."""
    h, inter = spec.hidden, 2 * spec.hidden
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab, h)}
    for layer in range(spec.layers):
        prefix = f"model.layers.{layer}"
        shapes[f"{prefix}.input_layernorm.weight"] = (h,)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{prefix}.self_attn.{proj}.weight"] = (h, h)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (h,)
        mlps = (
            [f"{prefix}.mlp.experts.{e}" for e in range(spec.experts)]
            if spec.experts
            else [f"{prefix}.mlp"]
        )
        if spec.experts:
            shapes[f"{prefix}.mlp.gate.weight"] = (spec.experts, h)
        for mlp in mlps:
            shapes[f"{mlp}.gate_proj.weight"] = (inter, h)
            shapes[f"{mlp}.up_proj.weight"] = (inter, h)
            shapes[f"{mlp}.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (spec.vocab, h)
    return shapes


def synthetic_nbytes(spec: SyntheticWeights) -> int:
    """Total bytes of the synthetic model (without generating it)."""
    return ITEMSIZE[spec.dtype] * sum(prod(shape) for shape in synthetic_shapes(spec).values())
