"""Trainer-side HF names onto the served checkpoint's names, where the two differ.

transformers 5 holds a mixture-of-experts layer's experts fused in memory:
``<layer>.experts.gate_up_proj`` ``[E, 2*I, H]`` (each expert's gate rows, then its up
rows) and ``<layer>.experts.down_proj`` ``[E, H, I]``.  Checkpoints (and so the model
vLLM serves, and its loader) name them per expert: ``<layer>.experts.<e>.gate_proj.weight``
``[I, H]``, ``...up_proj.weight`` ``[I, H]``, ``...down_proj.weight`` ``[H, I]``.
:func:`to_checkpoint_names` maps a refit's fused tensors onto those names as views (no
copy), and only where the served checkpoint has the per-expert names; anything it cannot
map (a fused tensor whose shape disagrees with the checkpoint's experts) is left as it
is, so the layout check refuses it before landing, with its name, instead of the loader
failing part-way.

Pure: torch only.  Must not import: vLLM, the operator.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_FUSED = re.compile(r"^(?P<layer>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def _expert_names(layer: str, kind: str, experts: int) -> list[list[str]]:
    """Per-expert checkpoint names a fused tensor of ``kind`` becomes."""
    parts: tuple[str, ...] = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    return [[f"{layer}.{e}.{p}.weight" for p in parts] for e in range(experts)]


def _split(
    name: str, tensor: torch.Tensor, served: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor] | None:
    """The per-expert views of one fused tensor, or None when it does not fit ``served``."""
    match = _FUSED.match(name)
    if match is None or tensor.ndim != 3:
        return None
    names = _expert_names(match["layer"], match["kind"], tensor.shape[0])
    if not all(n in served for per in names for n in per):
        return None
    out: dict[str, torch.Tensor] = {}
    for e, per in enumerate(names):
        # gate_up: the expert's rows [0, I) are gate, [I, 2I) up (transformers' chunk(2)).
        for piece, part in zip(tensor[e].chunk(len(per), dim=0), per, strict=True):
            if tuple(piece.shape) != served[part]:
                return None
            out[part] = piece
    return out


def to_checkpoint_names(
    weights: Mapping[str, torch.Tensor], served: Mapping[str, tuple[int, ...]] | None
) -> dict[str, torch.Tensor]:
    """``weights`` by the served checkpoint's names: fused expert tensors the checkpoint
    stores per expert are split into per-expert views; every other tensor as it is."""
    if served is None:
        return dict(weights)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        split = None if name in served else _split(name, tensor, served)
        if split is None:
            out[name] = tensor
        else:
            out.update(split)
    return out
