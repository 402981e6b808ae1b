"""The reference side of the fused-experts read-back, without vLLM.

Real: torch, and transformers 5's own ``Qwen2MoeExperts`` (the module the trainer holds)
as an independent computation of what a MoE layer gives.  Emulated: the served kernel's
output (the engines tier runs vLLM's).
"""

from __future__ import annotations

import pytest
import torch

from refit_worker.integrations.vllm.served import differs
from refit_worker.integrations.vllm.served_experts import (
    ExpertNames,
    expert_problems,
    expert_weights,
    probe_routing,
    reference_moe,
)

E, INTER, H = 4, 6, 8
NAMES = ExpertNames("model.layers.1.mlp.experts")


def _per_expert(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    sent = {}
    for e in range(E):
        gate, up, down = NAMES.of(e)
        sent[gate] = torch.randn(INTER, H, generator=generator)
        sent[up] = torch.randn(INTER, H, generator=generator)
        sent[down] = torch.randn(H, INTER, generator=generator)
    return sent


def test_per_expert_tensors_stack_gate_rows_then_up_rows_as_vllm_does() -> None:
    sent = _per_expert()
    got = expert_weights(sent, NAMES, E)
    assert not isinstance(got, str)
    w13, w2 = got
    assert w13.shape == (E, 2 * INTER, H) and w2.shape == (E, H, INTER)
    gate, up, down = NAMES.of(2)
    assert torch.equal(w13[2, :INTER], sent[gate]) and torch.equal(w13[2, INTER:], sent[up])
    assert torch.equal(w2[2], sent[down])


def test_fused_tensors_as_transformers_holds_them_are_taken_as_they_are() -> None:
    w13, w2 = torch.randn(E, 2 * INTER, H), torch.randn(E, H, INTER)
    sent = {f"{NAMES.layer}.gate_up_proj": w13, f"{NAMES.layer}.down_proj": w2}
    got = expert_weights(sent, NAMES, E)
    assert not isinstance(got, str)
    assert torch.equal(got[0], w13) and torch.equal(got[1], w2)


def test_a_missing_expert_tensor_is_named() -> None:
    sent = _per_expert()
    del sent[NAMES.of(3)[2]]
    assert expert_weights(sent, NAMES, E) == (
        "no tensor was sent for model.layers.1.mlp.experts.3.down_proj.weight"
    )


def test_the_probe_gives_every_expert_its_own_rows_with_weights_other_than_one() -> None:
    weights, ids = probe_routing(E, 4)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (E * 4, 1)
    assert ids.is_contiguous() and weights.is_contiguous()
    assert [int((ids == e).sum()) for e in range(E)] == [4] * E
    assert float(weights.min()) == 0.25 and float(weights.max()) == 1.0


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_reference_is_what_transformers_qwen2_moe_experts_compute(top_k: int) -> None:
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

    got = expert_weights(_per_expert(), NAMES, E)
    assert not isinstance(got, str)
    w13, w2 = got
    config = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E)
    experts = Qwen2MoeExperts(config)
    experts.gate_up_proj.data, experts.down_proj.data = w13.clone(), w2.clone()
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[e % E, (e + 1) % E] for e in range(6)])[:, :top_k]
    weights = torch.rand(6, top_k, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf = experts(x, ids, weights)
    ours = reference_moe(x, w13, w2, (weights, ids.to(torch.int32)))
    assert torch.allclose(ours, hf, atol=1e-5, rtol=1e-5)


def test_weight_on_input_scales_the_input_not_the_output() -> None:
    got = expert_weights(_per_expert(), NAMES, E)
    assert not isinstance(got, str)
    w13, w2 = got
    x = torch.randn(E * 2, H, generator=torch.Generator().manual_seed(4))
    weights, ids = probe_routing(E, 2)
    on_input = reference_moe(x, w13, w2, (weights, ids), weight_on_input=True)
    scaled_first = reference_moe(x * weights, w13, w2, (torch.ones_like(weights), ids))
    assert torch.allclose(on_input, scaled_first, atol=1e-5)
    assert not torch.allclose(on_input, reference_moe(x, w13, w2, (weights, ids)), atol=1e-3)


def _probe_case(sent: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    got = expert_weights(sent, NAMES, E)
    assert not isinstance(got, str)
    routing = probe_routing(E, 4)
    x = torch.randn(E * 4, H, generator=torch.Generator().manual_seed(3))
    return x, reference_moe(x, *got, routing), routing[1]


def test_a_served_kernel_that_gives_the_reference_within_rounding_passes() -> None:
    _, reference, ids = _probe_case(_per_expert())
    live = reference * (1 + 1e-6)
    assert expert_problems(live, reference, ids, NAMES, differs=differs, dtype=torch.float32) == []


def test_one_stale_expert_is_named_by_its_tensors_and_only_it() -> None:
    sent = _per_expert()
    _, reference, ids = _probe_case(sent)
    stale = dict(sent)
    stale[NAMES.of(2)[2]] = sent[NAMES.of(2)[2]] + 0.1  # down_proj of expert 2 one step old
    _, live, _ = _probe_case(stale)
    problems = expert_problems(live, reference, ids, NAMES, differs=differs, dtype=torch.float32)
    assert len(problems) == 1, problems
    assert problems[0].startswith(
        "model.layers.1.mlp.experts.2.{gate_proj,up_proj,down_proj}.weight: relative error"
    )


def test_experts_read_in_the_wrong_layout_all_differ() -> None:
    sent = _per_expert()
    x, reference, ids = _probe_case(sent)
    got = expert_weights(sent, NAMES, E)
    assert not isinstance(got, str)
    w13, w2 = got
    # What a kernel reading the raw layout as a packed one amounts to: the same numbers,
    # another arrangement.
    scrambled = w13.reshape(E, -1).flip(-1).reshape(w13.shape)
    live = reference_moe(x, scrambled, w2, probe_routing(E, 4))
    problems = expert_problems(live, reference, ids, NAMES, differs=differs, dtype=torch.float32)
    assert [p.split(".{")[0] for p in problems] == [f"{NAMES.layer}.{e}" for e in range(E)]
