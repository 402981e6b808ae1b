"""Trainer-side HF names onto the served checkpoint's names, where the two differ.

transformers 5 loads many families in another layout than their checkpoints store: it
fuses a mixture-of-experts layer's experts (``<layer>.experts.gate_up_proj``
``[E, 2*I, H]``, each expert's gate rows then its up rows, and ``...experts.down_proj``
``[E, H, I]``) and renames modules (Mixtral's ``block_sparse_moe`` is ``mlp`` in memory).
Checkpoints, and so the model vLLM serves and its loader, keep the original names
(``<layer>.experts.<e>.gate_proj.weight`` ``[I, H]``, Mixtral's ``...experts.<e>.w1.weight``).

transformers knows each family's conversion (its checkpoint conversion mapping, reverted by
``save_pretrained``).  :func:`to_checkpoint_names` reverts it for a refit's tensors, given
the served checkpoint's ``model_type`` (:func:`checkpoint_model_type`): renamings, and the
splits that undo a merge (``MergeModulelist``) or a concatenation (``Concatenate``) as
views of the sent tensors, no copy.  Without a model type, or for a family transformers
has no mapping for (or an older transformers without the mapping), it splits fused
experts by the ``gate_proj``/``up_proj``/``down_proj`` names as before.  A tensor whose
result does not fit the served checkpoint (a name it lacks, another shape), or that needs
an op that cannot be a view, is left as it is: the layout check then refuses the refit
before landing, naming it, instead of the loader failing part-way.

Pure: torch, and transformers when it is installed (imported at first use).  Must not
import: vLLM, the operator.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers.core_model_loading import WeightConverter, WeightRenaming

_FUSED = re.compile(r"^(?P<layer>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def checkpoint_model_type(model_dir: str | os.PathLike[str]) -> str | None:
    """``model_type`` of the checkpoint in ``model_dir`` (its ``config.json``); None when
    there is no such file (a hub id, a bare safetensors folder) or it names none."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) and model_type else None


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


def _reverse_mapping(
    model_type: str | None,
) -> tuple[list[WeightRenaming], list[WeightConverter]] | None:
    """(renamings, converters) that turn transformers' in-memory names of ``model_type``
    back into its checkpoint's, as ``save_pretrained`` does; None: no mapping known."""
    if model_type is None:
        return None
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
    except ImportError:  # no transformers here, or one older than its conversion mapping
        return None
    forward = get_checkpoint_conversion_mapping(model_type)  # type: ignore[no-untyped-call]
    if not forward:
        return None
    # Last transform first, each reversed; a prefix change is dropped, as save_pretrained
    # does for a model not loaded by from_pretrained: whether the prefix was there is unknown.
    reverse = [t.reverse_transform() for t in forward[::-1] if not isinstance(t, PrefixChange)]
    renamings = [t for t in reverse if isinstance(t, WeightRenaming)]
    return renamings, [t for t in reverse if isinstance(t, WeightConverter)]


def _run_ops(converter: WeightConverter, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Apply a reversed converter's ops to the one tensor it matched, as views; keys are
    its target patterns with each ``*`` numbered.  None: an op no view can express."""
    from transformers.core_model_loading import Chunk, SplitModulelist

    targets = converter.target_patterns
    pieces = {converter.source_patterns[0]: tensor}
    for op in converter.operations:
        if isinstance(op, Chunk) and op.num_shards_attribute is None and len(pieces) == 1:
            (whole,) = pieces.values()
            if whole.ndim <= op.dim or whole.shape[op.dim] % len(targets):
                return None
            pieces = dict(zip(targets, whole.chunk(len(targets), dim=op.dim), strict=True))
        elif isinstance(op, SplitModulelist) and all(t.ndim > op.dim for t in pieces.values()):
            # One piece: the converter's target names it; several (after a chunk): their own.
            named = {targets[0] if len(pieces) == 1 else k: t for k, t in pieces.items()}
            pieces = {
                k.replace("*", str(i)): part
                for k, t in named.items()
                for i, part in enumerate(t.unbind(op.dim))
            }
        else:  # a concatenation, a transpose...: a copy, or not invertible here
            return None
    return pieces


def _renamed(name: str, renamings: list[WeightRenaming]) -> str:
    """``name`` through every renaming in turn (after the ops, as transformers 5.25 saves;
    its ``apply_renamings`` is not in every transformers 5, ``rename_source_key`` is)."""
    for renaming in renamings:
        name, _ = renaming.rename_source_key(name)
    return name


def _convert(
    name: str, tensor: torch.Tensor, mapping: tuple[list[WeightRenaming], list[WeightConverter]]
) -> dict[str, torch.Tensor] | None:
    """``name``'s tensor by checkpoint names, by transformers' reversed mapping."""
    renamings, converters = mapping
    for converter in converters:
        # The matched pattern replaced by the converter's first target pattern.
        renamed, pattern = converter.rename_source_key(name)
        if pattern is None:
            continue
        head, found, tail = renamed.partition(converter.target_patterns[0])
        one_source = len(converter.source_patterns) == 1  # else the reverse joins tensors
        pieces = _run_ops(converter, tensor) if found and one_source else None
        if pieces is None:
            return None
        return {_renamed(head + k + tail, renamings): t for k, t in pieces.items()}
    return {_renamed(name, renamings): tensor}


def to_checkpoint_names(
    weights: Mapping[str, torch.Tensor],
    served: Mapping[str, tuple[int, ...]] | None,
    *,
    model_type: str | None = None,
) -> dict[str, torch.Tensor]:
    """``weights`` by the served checkpoint's names (``served``: name -> shape), reverting
    transformers' conversion for ``model_type`` (the checkpoint's ``config.json``
    ``model_type``, :func:`checkpoint_model_type`); without one, fused expert tensors the
    checkpoint stores per expert are split.  Views, never copies; a tensor the checkpoint
    already names, or whose result does not fit it, as it is."""
    if served is None:
        return dict(weights)
    mapping = _reverse_mapping(model_type)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name in served:
            converted = None
        elif mapping is None:
            converted = _split(name, tensor, served)
        else:
            converted = _convert(name, tensor, mapping)
        if converted is None or any(served.get(n) != tuple(t.shape) for n, t in converted.items()):
            out[name] = tensor
        else:
            out.update(converted)
    return out
