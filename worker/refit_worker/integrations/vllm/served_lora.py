"""vLLM's side of adapter refits: load and unload LoRA adapters on a worker, and read a
loaded adapter's A and B back from the LoRA layers that serve it.

The read-back reads what requests naming the adapter are computed with: the slot of the
adapter in each LoRA layer's stacked A/B buffers (vLLM 0.32 activates an adapter into a
slot when it is added).  vLLM folds the scaling ``alpha / rank`` into B when it loads an
adapter, so B is compared with ``B * scaling`` computed the same way; every other LoRA
module of the served model must be zero in that slot (the adapter touches nothing else).
The slots are read from the model's LoRA model manager, which vLLM attaches to the model
it wraps (``model.lora_manager``: ``lora_index_to_id``, ``modules``, ``packed_modules``);
no private attribute.  vLLM is imported only inside these functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from refit_worker.contract.adapters import AdapterHeader

#: PEFT's prefix on the module paths of ``get_peft_model_state_dict``'s names.
PEFT_PREFIX = "base_model.model."


def lora_calls(worker: Any) -> dict[str, Any]:
    """The ``load``, ``unload`` and ``read_back`` of an
    :class:`~refit_worker.integrations.vllm.adapter_landing.AdapterLanding` on ``worker``
    (no read-back with tensor parallelism: each worker holds slices)."""
    from vllm.lora.request import LoRARequest

    def load(version: str, lora_id: int, directory: Path) -> None:
        if not worker.add_lora(LoRARequest(version, lora_id, str(directory))):
            raise RuntimeError(f"vLLM already holds a LoRA with id {lora_id}")

    def unload(lora_id: int) -> None:
        worker.remove_lora(lora_id)

    def read_back(
        lora_id: int, header: AdapterHeader, sent: Mapping[str, torch.Tensor]
    ) -> list[str]:
        manager = worker.model_runner.get_model().lora_manager
        return served_differences(manager, lora_id, header, sent)

    tp = int(worker.vllm_config.parallel_config.tensor_parallel_size)
    return {"load": load, "unload": unload, "read_back": read_back if tp == 1 else None}


def _slices(manager: Any) -> dict[str, tuple[str, int]]:
    """Each module path a PEFT adapter may name -> (the served LoRA layer, its slice)."""
    found = {name: (name, 0) for name in manager.modules}
    for packed, parts in manager.packed_modules.items():
        for index, part in enumerate(parts):
            found[part] = (packed, index)
    return found


def served_differences(
    manager: Any, lora_id: int, header: AdapterHeader, sent: Mapping[str, torch.Tensor]
) -> list[str]:
    """How the LoRA layers serving ``lora_id`` differ from the adapter ``sent`` (empty:
    equal, and zero wherever the adapter has no tensor); ``manager``: vLLM's LoRA model
    manager of the served model."""
    if lora_id not in manager.lora_index_to_id:
        return [f"LoRA {lora_id} is not active in any slot"]
    slot = manager.lora_index_to_id.index(lora_id)
    where = _slices(manager)
    scaling = header.alpha / header.rank
    expected: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    problems: list[str] = []
    for name in sorted({n.rsplit(".lora_", 1)[0] for n in sent}):
        path = name.removeprefix(PEFT_PREFIX)
        if path not in where:
            problems.append(f"{path}: no LoRA layer of vLLM serves it")
            continue
        a, b = sent[f"{name}.lora_A.weight"], sent[f"{name}.lora_B.weight"]
        expected[where[path]] = (a, b)
    for layer_name, layer in manager.modules.items():
        stacks = list(
            zip(_stacked(layer.lora_a_stacked), _stacked(layer.lora_b_stacked), strict=True)
        )
        for index, (a, b) in enumerate(stacks):
            pair = expected.get((layer_name, index))
            problems += _compare(f"{layer_name}[{index}]", a[slot], b[slot], pair, scaling)
    return problems


def _stacked(stacked: Any) -> tuple[torch.Tensor, ...]:
    """A layer's stacked buffers, one per slice (a layer of one slice may hold a tensor)."""
    return (stacked,) if isinstance(stacked, torch.Tensor) else tuple(stacked)


def _compare(
    label: str,
    served_a: torch.Tensor,
    served_b: torch.Tensor,
    pair: tuple[torch.Tensor, torch.Tensor] | None,
    scaling: float,
) -> list[str]:
    if pair is None:  # a module the adapter does not touch: nothing may be there
        if served_a.any() or served_b.any():
            return [f"{label}: holds LoRA weights the adapter has none of"]
        return []
    a, b = pair
    served_a, served_b = (
        served_a.reshape(-1, served_a.shape[-1]),
        served_b.reshape(-1, served_b.shape[-1]),
    )
    got_a = served_a[: a.shape[0], : a.shape[1]]
    got_b = served_b[: b.shape[0], : b.shape[1]]
    want_b = b.to(got_b.dtype) * scaling
    problems = []
    if not torch.equal(got_a, a.to(got_a.dtype)):
        problems.append(
            f"{label}: A differs (max {float((got_a - a.to(got_a.dtype)).abs().max()):.3g})"
        )
    if not torch.equal(got_b, want_b):
        problems.append(f"{label}: B differs (max {float((got_b - want_b).abs().max()):.3g})")
    return problems
