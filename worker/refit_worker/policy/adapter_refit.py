"""An adapter refit's items: the PEFT adapter's tensors, checked against their header,
and the header itself as the extra that rides with them (same transport, same hashes)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refit_worker.contract.adapters import (
    ADAPTER_EXTRA_NAME,
    EXTRAS,
    AdapterHeader,
    adapter_problems,
)


class NotAnAdapterError(ValueError):
    """The tensors given as an adapter refit are not the adapter its header describes."""


def adapter_items(
    items: Sequence[tuple[str, torch.Tensor]], header: AdapterHeader
) -> list[tuple[str, torch.Tensor]]:
    """``items`` (``get_peft_model_state_dict(model).items()``, DTensors under FSDP2, and
    any extras) and the header's extra; :class:`NotAnAdapterError` naming the problems
    when they are not the adapter ``header`` describes (checked by global shapes: no
    gather)."""
    shapes = {name: tuple(t.shape) for name, t in items if not name.startswith(EXTRAS)}
    problems = adapter_problems(header, shapes)
    if problems:
        raise NotAnAdapterError(
            f"not the LoRA adapter its header describes: {'; '.join(problems[:5])}"
        )
    encoded = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
    return [*items, (ADAPTER_EXTRA_NAME, encoded)]
