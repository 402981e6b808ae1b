"""The expected served tensors built from HF tensors with a model's own name mapping.

Pure: a stand-in for vLLM's ``WeightsMapper`` (its public ``map_name`` and
``orig_to_new_stacked``, as vLLM 0.32's Qwen2 declares them) and plain tensors; the
read-back through vLLM's kernels runs in the engines tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from refit_worker.integrations.vllm.served import differs, expected_params

STACKED = {
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}


@dataclass
class Mapper:
    orig_to_new_stacked: dict[str, tuple[str, object]] = field(default_factory=lambda: STACKED)

    def map_name(self, key: str) -> str | None:
        for substr, (new, _) in self.orig_to_new_stacked.items():
            if substr in key:
                key = key.replace(substr, new, 1)
        return key


class Model(torch.nn.Module):
    hf_to_vllm_mapper = Mapper()


def test_stacked_parts_are_concatenated_in_shard_order_whatever_the_sending_order() -> None:
    p = "model.layers.0"
    q, k, v = torch.full((4, 2), 1.0), torch.full((2, 2), 2.0), torch.full((2, 2), 3.0)
    gate, up = torch.full((3, 2), 4.0), torch.full((3, 2), 5.0)
    sent = {
        f"{p}.self_attn.v_proj.weight": v,
        f"{p}.mlp.up_proj.weight": up,
        f"{p}.self_attn.q_proj.weight": q,
        f"{p}.self_attn.k_proj.weight": k,
        f"{p}.mlp.gate_proj.weight": gate,
        "model.norm.weight": torch.ones(2),
    }
    got = expected_params(Model(), sent)
    assert set(got) == {
        f"{p}.self_attn.qkv_proj.weight",
        f"{p}.mlp.gate_up_proj.weight",
        "model.norm.weight",
    }
    assert torch.equal(got[f"{p}.self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
    assert torch.equal(got[f"{p}.mlp.gate_up_proj.weight"], torch.cat([gate, up]))


def test_a_stale_tensor_differs_and_kernel_rounding_does_not() -> None:
    expected = torch.randn(8, 8)
    assert differs(expected + 1e-6, expected, torch.float32) is None
    stale = torch.randn(8, 8)
    problem = differs(stale, expected, torch.float32)
    assert problem is not None and problem.startswith("relative error")
    assert differs(expected[:4], expected, torch.float32) == "shape (4, 8), expected (8, 8)"
