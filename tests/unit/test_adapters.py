"""The adapter refit's contract: header, base check, names of versions, tensor checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from refit_worker.contract.adapters import (
    AdapterHeader,
    AdapterKnobs,
    adapter_problems,
    base_refusal,
    checkpoint_digest,
    header_json,
    version_name,
)

HEADER = AdapterHeader(
    name="job",
    rank=4,
    alpha=8.0,
    target_modules=("q_proj", "v_proj"),
    base="tiny-llama",
    base_digest="0123456789abcdef0123456789abcdef",
)
Q = "base_model.model.model.layers.0.self_attn.q_proj"


def test_the_same_base_digest_is_accepted() -> None:
    assert base_refusal(HEADER, "anything", HEADER.base_digest) is None


def test_another_base_is_refused_naming_both_digests_and_bases() -> None:
    why = base_refusal(HEADER, "other-llama", "f" * 32)
    assert why is not None
    assert HEADER.base_digest in why and "f" * 32 in why
    assert "'tiny-llama'" in why and "'other-llama'" in why


def test_versions_carry_the_refit() -> None:
    assert version_name("job", 0) == "job-v0"
    assert version_name("job", 12) != version_name("job", 1)


def test_header_round_trips_through_its_bytes_only() -> None:
    assert header_json(list(HEADER.encode())) == HEADER
    with pytest.raises(ValueError, match="not JSON"):
        header_json(b"\x80\x04pickle")
    with pytest.raises(ValidationError):
        header_json(HEADER.encode().replace(b'"rank":4', b'"rank":0'))


def test_peft_config_names_rank_alpha_and_targets() -> None:
    config = HEADER.peft_config()
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["target_modules"] == ["q_proj", "v_proj"]


def test_a_proper_adapter_has_no_problem() -> None:
    shapes = {f"{Q}.lora_A.weight": (4, 64), f"{Q}.lora_B.weight": (128, 4)}
    assert adapter_problems(HEADER, shapes) == []


@pytest.mark.parametrize(
    ("shapes", "expected"),
    [
        ({"model.embed_tokens.weight": (10, 4)}, "no PEFT LoRA tensor"),
        ({f"{Q}.lora_A.weight": (4, 64)}, "lacks lora_B"),
        ({f"{Q}.lora_A.weight": (8, 64), f"{Q}.lora_B.weight": (128, 8)}, "not of rank 4"),
        (
            {"m.k_proj.lora_A.weight": (4, 64), "m.k_proj.lora_B.weight": (64, 4)},
            "not on a target module",
        ),
        ({}, "no LoRA tensor"),
    ],
)
def test_what_is_not_the_described_adapter_is_named(
    shapes: dict[str, tuple[int, ...]], expected: str
) -> None:
    problems = adapter_problems(HEADER, shapes)
    assert any(expected in p for p in problems), problems


def test_checkpoint_digest_follows_the_bytes(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    first = checkpoint_digest(tmp_path)
    assert first == checkpoint_digest(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"abd")
    assert checkpoint_digest(tmp_path) != first
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        checkpoint_digest(tmp_path / "missing")


def test_knobs_refuse_names_vllm_could_not_serve() -> None:
    with pytest.raises(ValidationError):
        AdapterKnobs(name="Bad_Name")
    with pytest.raises(ValidationError):
        AdapterKnobs(keep=0)


def test_the_extra_name_is_the_staged_receivers() -> None:
    from refit_worker.contract.adapters import ADAPTER_EXTRA, ADAPTER_EXTRA_NAME
    from refit_worker.integrations.staged import EXTRA_PREFIX

    assert EXTRA_PREFIX + ADAPTER_EXTRA == ADAPTER_EXTRA_NAME


def test_adapter_items_append_the_header_and_refuse_other_tensors() -> None:
    import torch

    from refit_worker.contract.adapters import ADAPTER_EXTRA_NAME
    from refit_worker.integrations.staged import split_extras
    from refit_worker.policy.adapter_refit import NotAnAdapterError, adapter_items

    state = [(f"{Q}.lora_A.weight", torch.ones(4, 64)), (f"{Q}.lora_B.weight", torch.zeros(128, 4))]
    items = adapter_items(state, HEADER)
    assert items[:2] == state and items[2][0] == ADAPTER_EXTRA_NAME
    weights, extras = split_extras(dict(items))
    assert set(weights) == {n for n, _ in state}
    assert header_json(extras["adapter"].tolist()) == HEADER
    with pytest.raises(NotAnAdapterError, match="no PEFT LoRA tensor"):
        adapter_items([("model.norm.weight", torch.ones(64))], HEADER)


def test_vllm_must_hold_the_kept_versions_and_the_landing_one() -> None:
    from types import SimpleNamespace

    from refit_worker.integrations.vllm.adapter_landing import lora_capacity_problem

    assert "enable_lora" in str(lora_capacity_problem(None, 1))
    assert lora_capacity_problem(SimpleNamespace(max_cpu_loras=None, max_loras=2), 1) is None
    assert lora_capacity_problem(SimpleNamespace(max_cpu_loras=3, max_loras=1), 2) is None
    why = lora_capacity_problem(SimpleNamespace(max_cpu_loras=None, max_loras=1), 1)
    assert why is not None and "max_cpu_loras is 1" in why and "keep=1" in why


def _served(slot_of: int, a: Any, b: Any, scaling: float) -> Any:
    """A LoRA model manager's public face (as vLLM 0.32 lays it out) with a packed qkv
    layer and a plain one, the adapter ``a``/``b`` on q_proj in slot ``slot_of``."""
    from types import SimpleNamespace

    import torch

    layer = "model.layers.0.self_attn"
    qkv = SimpleNamespace(
        lora_a_stacked=tuple(torch.zeros(2, 1, 8, 64) for _ in range(3)),
        lora_b_stacked=(
            torch.zeros(2, 1, 128, 8),
            torch.zeros(2, 1, 32, 8),
            torch.zeros(2, 1, 32, 8),
        ),
    )
    qkv.lora_a_stacked[0][slot_of, 0, :4, :] = a
    qkv.lora_b_stacked[0][slot_of, 0, :, :4] = b * scaling
    o = SimpleNamespace(
        lora_a_stacked=torch.zeros(2, 1, 8, 128), lora_b_stacked=torch.zeros(2, 1, 64, 8)
    )
    return SimpleNamespace(
        lora_index_to_id=[None, 7],
        modules={f"{layer}.qkv_proj": qkv, f"{layer}.o_proj": o},
        packed_modules={
            f"{layer}.qkv_proj": [f"{layer}.{p}" for p in ("q_proj", "k_proj", "v_proj")]
        },
    )


def test_the_read_back_finds_what_the_served_slots_hold_that_was_not_sent() -> None:
    import torch

    from refit_worker.integrations.vllm.served_lora import served_differences

    header = HEADER.model_copy(update={"target_modules": ("q_proj",)})
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 64, generator=gen), torch.randn(128, 4, generator=gen)
    sent = {f"{Q}.lora_A.weight": a, f"{Q}.lora_B.weight": b}
    served = _served(1, a, b, header.alpha / header.rank)
    assert served_differences(served, 7, header, sent) == []
    assert served_differences(served, 3, header, sent) == ["LoRA 3 is not active in any slot"]
    served.modules["model.layers.0.self_attn.qkv_proj"].lora_a_stacked[0][1, 0, 0, 0] += 1e-3
    served.modules["model.layers.0.self_attn.o_proj"].lora_b_stacked[1, 0, 0, 0] = 1.0
    problems = served_differences(served, 7, header, sent)
    assert any("qkv_proj[0]: A differs" in p for p in problems), problems
    assert any("o_proj[0]: holds LoRA weights" in p for p in problems), problems
    unscaled = _served(1, a, b, 1.0)  # B without vLLM's alpha / rank: not what is served
    assert any("B differs" in p for p in served_differences(unscaled, 7, header, sent))
