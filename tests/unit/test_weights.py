"""Synthetic and safetensors weight sources.  Pure (tensors in memory, files in tmp_path)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from refit_worker.contract.config import SafetensorsWeights, SyntheticWeights
from refit_worker.contract.dtypes import ITEMSIZE, SYNTHETIC_DTYPE_NAMES, WIRE_DTYPE_NAMES
from refit_worker.contract.synthetic import synthetic_nbytes, synthetic_shapes
from refit_worker.engine.base import dtype_from_name
from refit_worker.pod.weights import advance, load_safetensors, synthetic_state_dict


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)  # 0-dim tensors cannot change element size


def _equal_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(_bytes(a[k]), _bytes(b[k])) for k in a)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16", "int8", "float8_e4m3fn"])
def test_synthetic_is_deterministic_and_advances(dtype: str) -> None:
    spec = SyntheticWeights(layers=2, hidden=16, vocab=32, dtype=dtype, seed=7)
    first, again = synthetic_state_dict(spec), synthetic_state_dict(spec)
    assert _equal_bits(first, again)
    stepped = synthetic_state_dict(spec)
    advance(stepped, 1)
    assert not any(
        torch.equal(first[k].view(torch.uint8), stepped[k].view(torch.uint8)) for k in first
    )
    assert _equal_bits(stepped, synthetic_state_dict(spec, refit=1))
    other_seed = synthetic_state_dict(spec.model_copy(update={"seed": 8}))
    assert not _equal_bits(first, other_seed)


def test_shapes_and_nbytes_agree() -> None:
    spec = SyntheticWeights(layers=3, hidden=8, vocab=10, experts=2)
    state = synthetic_state_dict(spec)
    assert {k: tuple(v.shape) for k, v in state.items()} == synthetic_shapes(spec)
    assert sum(t.numel() * t.element_size() for t in state.values()) == synthetic_nbytes(spec)
    assert "model.layers.2.mlp.experts.1.down_proj.weight" in state


@pytest.mark.parametrize(
    "spec",
    [
        SyntheticWeights(),
        SyntheticWeights(layers=1, hidden=1, vocab=1),
        SyntheticWeights(layers=3, hidden=8, vocab=10, experts=2),
        SyntheticWeights(layers=7, hidden=5, vocab=3, experts=1, dtype="float32"),
    ],
)
def test_the_size_from_the_sizes_alone_is_what_the_shapes_add_up_to(spec: SyntheticWeights) -> None:
    listed = sum(math.prod(shape) for shape in synthetic_shapes(spec).values())
    assert synthetic_nbytes(spec) == ITEMSIZE[spec.dtype] * listed


@pytest.mark.parametrize("name", WIRE_DTYPE_NAMES)
def test_itemsizes_agree_with_torch(name: str) -> None:
    assert ITEMSIZE[name] == torch.empty((), dtype=dtype_from_name(name)).element_size()


def test_unknown_dtype_is_named() -> None:
    with pytest.raises(ValueError, match="'complex32'"):
        dtype_from_name("complex32")


@pytest.mark.parametrize("name", SYNTHETIC_DTYPE_NAMES)
def test_every_dtype_the_models_accept_is_generated_and_advanced(name: str) -> None:
    spec = SyntheticWeights(layers=1, hidden=4, vocab=8, dtype=name)  # type: ignore[arg-type]
    state = synthetic_state_dict(spec, refit=2)
    assert {t.dtype for t in state.values()} == {dtype_from_name(name)}
    assert sum(t.numel() * t.element_size() for t in state.values()) == synthetic_nbytes(spec)


def test_safetensors_directory(tmp_path: Path) -> None:
    save_file({"b": torch.arange(4, dtype=torch.float16)}, str(tmp_path / "2.safetensors"))
    save_file({"a": torch.ones(2, 2)}, str(tmp_path / "1.safetensors"))
    state = load_safetensors(SafetensorsWeights(path=str(tmp_path)))
    assert list(state) == ["a", "b"]
    assert torch.equal(state["b"], torch.arange(4, dtype=torch.float16))


def test_safetensors_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_safetensors(SafetensorsWeights(path=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_safetensors(SafetensorsWeights(path=str(tmp_path / "missing")))
    save_file({"a": torch.ones(1)}, str(tmp_path / "1.safetensors"))
    save_file({"a": torch.zeros(1)}, str(tmp_path / "2.safetensors"))
    with pytest.raises(ValueError, match="more than one file"):
        load_safetensors(SafetensorsWeights(path=str(tmp_path)))


def test_a_checkpoint_of_every_wire_dtype_advances(tmp_path: Path) -> None:
    """Real checkpoints hold integer tensors (positions, counters) and scalars too."""
    tensors = {
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "count": torch.tensor(7, dtype=torch.int32),
        "mask": torch.tensor([True, False]),
        "w": torch.ones(3, dtype=torch.float64),
        "q": torch.zeros(4, dtype=torch.float8_e5m2),
    }
    save_file(tensors, str(tmp_path / "m.safetensors"))
    state = load_safetensors(SafetensorsWeights(path=str(tmp_path)))
    again = load_safetensors(SafetensorsWeights(path=str(tmp_path)))
    advance(state, 1)
    advance(again, 1)
    assert _equal_bits(state, again)  # deterministic
    for name, before in tensors.items():
        assert not torch.equal(_bytes(state[name]), _bytes(before)), name
        assert state[name].dtype == before.dtype and state[name].shape == before.shape
