"""Fused expert tensors (transformers 5) onto a checkpoint's per-expert names: pure."""

from __future__ import annotations

import pytest
import torch

from refit_worker.integrations.hf_names import to_checkpoint_names

E, INTER, H = 3, 4, 5
LAYER = "model.layers.0.mlp.experts"


def _served(experts: int = E) -> dict[str, tuple[int, ...]]:
    served: dict[str, tuple[int, ...]] = {"model.norm.weight": (H,)}
    for e in range(experts):
        served[f"{LAYER}.{e}.gate_proj.weight"] = (INTER, H)
        served[f"{LAYER}.{e}.up_proj.weight"] = (INTER, H)
        served[f"{LAYER}.{e}.down_proj.weight"] = (H, INTER)
    return served


def test_fused_experts_become_per_expert_views_gate_rows_first() -> None:
    gate_up = torch.arange(E * 2 * INTER * H, dtype=torch.float32).reshape(E, 2 * INTER, H)
    down = torch.randn(E, H, INTER)
    norm = torch.ones(H)
    out = to_checkpoint_names(
        {f"{LAYER}.gate_up_proj": gate_up, f"{LAYER}.down_proj": down, "model.norm.weight": norm},
        _served(),
    )
    assert set(out) == set(_served())
    for e in range(E):
        assert torch.equal(out[f"{LAYER}.{e}.gate_proj.weight"], gate_up[e, :INTER])
        assert torch.equal(out[f"{LAYER}.{e}.up_proj.weight"], gate_up[e, INTER:])
        assert torch.equal(out[f"{LAYER}.{e}.down_proj.weight"], down[e])
        # Views of the staging memory, not copies.
        assert out[f"{LAYER}.{e}.up_proj.weight"].data_ptr() == gate_up[e, INTER:].data_ptr()
    assert out["model.norm.weight"] is norm


@pytest.mark.parametrize(
    ("served", "shape"),
    [
        (_served(experts=E - 1), (E, 2 * INTER, H)),  # the checkpoint has fewer experts
        (_served(), (E, 2 * INTER, H + 1)),  # the hidden size differs
        (None, (E, 2 * INTER, H)),  # no served layout known: nothing to map onto
    ],
)
def test_a_fused_tensor_that_does_not_fit_is_left_for_the_layout_check(
    served: dict[str, tuple[int, ...]] | None, shape: tuple[int, ...]
) -> None:
    fused = torch.zeros(shape)
    out = to_checkpoint_names({f"{LAYER}.gate_up_proj": fused}, served)
    assert list(out) == [f"{LAYER}.gate_up_proj"] and out[f"{LAYER}.gate_up_proj"] is fused
