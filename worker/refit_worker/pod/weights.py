"""Where a policy rank's weights come from, and how they change between refits.

Two sources, chosen by ``WorkerConfig.weights``:

- a **synthetic**, transformer-shaped state dict generated from a seed (for demos,
  benchmarks and end-to-end checks: any process can regenerate the exact tensors of refit
  ``k`` and compare bit for bit), and
- every ``*.safetensors`` file of a directory (real checkpoints on a mounted volume).

Between refits the policy "trains": :func:`advance` changes every tensor in place in a
deterministic way, so each refit carries new values and a stale refit cannot pass as fresh.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from refit_worker.contract.config import SafetensorsWeights, SyntheticWeights, WeightsSource
from refit_worker.contract.failures import MissingWeightsError, UnsupportedWeightsError
from refit_worker.contract.synthetic import synthetic_shapes
from refit_worker.engine import SAME_WIDTH_INT, WIRE_DTYPES, dtype_from_name

StateDict = dict[str, torch.Tensor]


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def synthetic_state_dict(spec: SyntheticWeights, refit: int = 0) -> StateDict:
    """The synthetic model as it is at refit ``refit`` (0: freshly initialised)."""
    dtype = dtype_from_name(spec.dtype)
    state: StateDict = {}
    for name, shape in synthetic_shapes(spec).items():
        gen = torch.Generator().manual_seed(_tensor_seed(spec.seed, name))
        values = torch.randn(shape, generator=gen, dtype=torch.float32)
        if dtype in (torch.int8,):
            state[name] = (values * 16).clamp_(-127, 127).to(dtype)
        else:
            state[name] = values.to(dtype)
    for step in range(1, refit + 1):
        advance(state, step, spec.changes)
    return state


def advance(state: StateDict, refit: int, changes: float | None = None) -> None:
    """Change every tensor in place for refit ``refit`` (a stand-in for an optimiser step).

    ``changes``: the share of each tensor's elements that change (every ``1/changes``-th
    one, from an offset that moves with the step), as most bf16 elements keep their value
    through a small optimiser step; None: all of them.

    Deterministic: applying steps ``1..k`` to a fresh state always gives the same bits, which
    is what lets a rollout rank (or a test) check a received refit exactly.
    """
    # None: the whole tensor; else a view of every stride-th element.
    stride = None if changes is None or changes >= 1 else max(1, round(1 / changes))
    for whole in state.values():
        rotated = not (whole.dtype == torch.bool or _float_arith(whole))
        # A strided view, or a byte-wise rotation, needs the tensor's own flat memory.
        if (stride is not None or rotated) and not whole.is_contiguous():
            raise ValueError("advance needs contiguous tensors (views of one buffer)")
        tensor = whole if stride is None else whole.view(-1)[refit % stride :: stride]
        if tensor.dtype == torch.bool:
            tensor.logical_not_()
        elif _float_arith(tensor):
            tensor.add_(0.5 * refit)
        # Integers (a float step cannot be cast to them) and fp8 (no CPU arithmetic): a
        # byte-wise rotation still changes every value, deterministically; in a strided
        # view, elements of several bytes rotate their low byte.
        elif tensor is whole:
            tensor.reshape(-1).view(torch.uint8).add_(refit % 7 + 1)
        else:
            tensor.view(SAME_WIDTH_INT[tensor.element_size()]).add_(refit % 7 + 1)


def _float_arith(tensor: torch.Tensor) -> bool:
    """Whether a float step can be added to ``tensor`` on the CPU (not fp8)."""
    return tensor.is_floating_point() and tensor.dtype not in _FP8


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def load_safetensors(source: SafetensorsWeights) -> StateDict:
    """Load every ``*.safetensors`` file under ``source.path`` (sorted by file name)."""
    from safetensors.torch import load_file

    root = Path(source.path)
    if not root.is_dir():
        raise MissingWeightsError(f"weights directory {root} does not exist or is not a directory")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise MissingWeightsError(f"no *.safetensors files in {root}")
    state: StateDict = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if name in state:
                raise ValueError(f"tensor {name!r} appears in more than one file under {root}")
            _check_dtype(file, name, tensor)
            state[name] = tensor
    return state


def _check_dtype(file: Path, name: str, tensor: torch.Tensor) -> None:
    """Refuse at load time a tensor the wire cannot carry, not at the first refit."""
    if tensor.dtype not in _WIRE:
        shown = str(tensor.dtype).removeprefix("torch.")
        raise UnsupportedWeightsError(
            f"{file}: tensor {name!r} has dtype {shown}, which refit cannot transfer;"
            f" supported: {', '.join(sorted(WIRE_DTYPES))}"
        )


_WIRE = frozenset(WIRE_DTYPES.values())


def load_weights(source: WeightsSource) -> StateDict:
    """The initial state dict for ``source``."""
    if isinstance(source, SyntheticWeights):
        return synthetic_state_dict(source)
    return load_safetensors(source)
