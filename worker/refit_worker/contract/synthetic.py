"""The synthetic model's layout: names, shapes and size, computed without building it.

The worker generates the tensors (``refit_worker.pod.weights``); the operator's local runner
sizes a job from the same layout before it starts a process, so both read it here.
"""

from __future__ import annotations

from refit_worker.contract.config import SyntheticWeights
from refit_worker.contract.dtypes import ITEMSIZE


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
    """Total bytes of the synthetic model, from its sizes alone: what
    :func:`synthetic_shapes` lists, without listing it (a job at the bounds has millions
    of tensors, and ``refit run`` sizes it before anything starts)."""
    h, experts = spec.hidden, spec.experts
    mlp = 3 * (2 * h * h)  # gate, up and down projections
    # Two norms, four attention projections, then one MLP or a router and the experts.
    layer = 2 * h + 4 * h * h + (experts * h + experts * mlp if experts else mlp)
    elements = 2 * spec.vocab * h + h + spec.layers * layer  # embeddings, head, final norm
    return ITEMSIZE[spec.dtype] * elements
