"""Whether the tensors a caller receives into match the refit's (:func:`layout_problems`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..base import dtype_from_name
from ..planning.buckets import TensorSpec

_SHOWN = 8


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" (+{len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")


def layout_problems(
    specs: Sequence[TensorSpec], targets: Mapping[str, torch.Tensor], device: torch.device
) -> list[str]:
    """Every way ``targets`` differ from the sent ``specs`` (empty: they match)."""
    want = {spec.name: spec for spec in specs}
    problems = []
    missing = sorted(set(want) - set(targets))
    extra = sorted(set(targets) - set(want))
    if missing:
        problems.append(f"sent but not in the target: {_listing(missing)}")
    if extra:
        problems.append(f"in the target but not sent: {_listing(extra)}")
    for name in sorted(set(want) & set(targets)):
        spec, tensor = want[name], targets[name]
        if tensor.dtype != dtype_from_name(spec.dtype) or tuple(tensor.shape) != spec.shape:
            problems.append(
                f"{name!r}: sent {spec.dtype}{list(spec.shape)}, target has "
                f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
            )
        elif not tensor.is_contiguous():
            problems.append(f"{name!r}: the target tensor is not contiguous")
        elif tensor.device.type != device.type:
            problems.append(f"{name!r}: the target is on {tensor.device}, the engine on {device}")
    return problems


__all__ = ["layout_problems"]
