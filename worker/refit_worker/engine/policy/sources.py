"""A policy rank's source tensors for one refit: materialised, sliced per target, and the
moment the NIC may read them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..base import dtype_name
from ..planning.buckets import check_unique_names
from ..planning.layout import WHOLE, TargetWeightLayout, select_slice


def prepare_sources(
    weights: Iterable[tuple[str, torch.Tensor]], device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """Materialise the generator: contiguous tensors on ``device``; bad input raises."""
    items: list[tuple[str, torch.Tensor]] = []
    for entry in weights:
        name, tensor = entry
        if not isinstance(name, str) or not name:
            raise ValueError(f"weight names must be non-empty strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor")
        dtype_name(tensor.dtype)
        tensor = tensor.detach()
        if tensor.device.type != device.type:
            tensor = tensor.to(device)
        items.append((name, tensor.contiguous()))
    check_unique_names([name for name, _ in items])
    return items


def for_target(
    items: Sequence[tuple[str, torch.Tensor]], layout: TargetWeightLayout | None
) -> dict[str, torch.Tensor]:
    """The tensors (or tensor-parallel slices, made contiguous) that one target wants."""
    chosen: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        part = select_slice(name, tuple(tensor.shape), layout)
        if part is None:
            continue
        sent = tensor if part == WHOLE else tensor.narrow(part.dim, part.start, part.length)
        chosen[name] = sent.contiguous()
    return chosen


def sources_ready(device: torch.device) -> torch.cuda.Event | None:
    """After the last source copy or slice is queued: wait for it without a device sync.

    On CUDA the ``.to()``/``.contiguous()`` copies of :func:`prepare_sources` and
    :func:`for_target` are queued on the current stream; the NIC must not read a source
    before they finish.  Returns the recorded event (hash threads wait on it too).
    """
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    event.synchronize()
    return event


__all__ = ["for_target", "prepare_sources", "sources_ready"]
