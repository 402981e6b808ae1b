"""A trainer's in-memory transformers state dict onto its checkpoint's names, per family:
what :func:`to_checkpoint_names` makes of ``model.state_dict()`` is what
``save_pretrained`` writes, name for name and bit for bit, as views of the sent tensors.

Real: tiny transformers models built here (no download) and their saved safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open

from refit_worker.integrations.hf_names import checkpoint_model_type, to_checkpoint_names

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "tie_word_embeddings": False,  # a tied lm_head is in state_dict, not in the checkpoint
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
#: family -> (config class, model class, its size beyond SMALL)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    # A router renamed too: the checkpoint's block_sparse_moe.gate is mlp.router in memory.
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", {"num_local_experts": 4}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {**MOE, "shared_expert_intermediate_size": 64},
    ),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", MOE),
    # Mapped through qwen2_moe's conversion; layer 0 dense, layer 1 experts + a shared one.
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
        },
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),  # no conversion: nothing changes
}


def _build(family: str, **size: Any) -> torch.nn.Module:
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**SMALL, **extra, **size})
    model: torch.nn.Module = getattr(transformers, model_cls)(config)
    return model


def _saved(model: Any, where: Path) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes: every tensor of its safetensors files."""
    model.save_pretrained(where)
    out = {}
    for file in sorted(where.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118  # safe_open has no __iter__
                out[name] = handle.get_tensor(name)
    assert out
    return out


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_state_dict_maps_onto_what_save_pretrained_writes(family: str, tmp_path: Path) -> None:
    model = _build(family)
    memory = model.state_dict()
    saved = _saved(model, tmp_path)
    served = {n: tuple(t.shape) for n, t in saved.items()}
    model_type = checkpoint_model_type(tmp_path)
    assert model_type == family

    out = to_checkpoint_names(memory, served, model_type=model_type)

    assert sorted(out) == sorted(saved)
    for name, tensor in out.items():
        assert tensor.dtype == saved[name].dtype, name
        assert torch.equal(_bits(tensor), _bits(saved[name])), name
    # Views of the sent tensors, no copy: each shares the storage of one of them.
    storages = {t.untyped_storage().data_ptr() for t in memory.values()}
    assert all(t.untyped_storage().data_ptr() in storages for t in out.values())
    renamed = out.keys() - memory.keys()
    if family == "llama":
        assert not renamed and all(out[n] is memory[n] for n in memory)
    else:
        assert renamed  # the case is about a conversion: it did happen


def test_mixtral_experts_are_views_of_the_fused_tensor(tmp_path: Path) -> None:
    model = _build("mixtral")
    memory = model.state_dict()
    served = {n: tuple(t.shape) for n, t in _saved(model, tmp_path).items()}
    out = to_checkpoint_names(memory, served, model_type="mixtral")
    fused = memory["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, H]: gate rows, then up
    up = out["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    assert up.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert up.data_ptr() == fused[3, 64:].data_ptr()
    assert torch.equal(out["model.layers.1.block_sparse_moe.experts.3.w1.weight"], fused[3, :64])
    assert (
        out["model.layers.1.block_sparse_moe.gate.weight"]
        is memory["model.layers.1.mlp.gate.weight"]
    )


@pytest.mark.parametrize(
    ("family", "other"),
    [
        ("mixtral", {"intermediate_size": 32}),  # the served experts are of another size
        ("mixtral", {"num_local_experts": 2}),  # the served model has fewer experts
        ("qwen3_moe", {"moe_intermediate_size": 16}),
    ],
)
def test_a_checkpoint_of_another_size_leaves_the_experts_unmapped(
    family: str, other: dict[str, Any], tmp_path: Path
) -> None:
    memory = _build(family).state_dict()
    served = {n: tuple(t.shape) for n, t in _saved(_build(family, **other), tmp_path).items()}

    out = to_checkpoint_names(memory, served, model_type=family)

    fused = [n for n in memory if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 4 and all(out[n] is memory[n] for n in fused)
    # So the layout check names them: sent but not served, and served experts not sent.
    assert set(fused) <= out.keys() - served.keys()
    # (With 2 served experts the router differs too: 2 rows, so it stays unmapped as well.)
    missing = served.keys() - out.keys()
    assert missing and all(".experts." in n or ".gate." in n for n in missing)


def test_without_the_model_type_mixtral_stays_unmapped(tmp_path: Path) -> None:
    """The old split knows only gate_proj/up_proj names: Mixtral needs transformers' map."""
    memory = _build("mixtral").state_dict()
    served = {n: tuple(t.shape) for n, t in _saved(_build("mixtral"), tmp_path).items()}
    assert to_checkpoint_names(memory, served).keys() == memory.keys()
    unknown = to_checkpoint_names(memory, served, model_type="no-such-family")
    assert unknown.keys() == memory.keys()


def test_checkpoint_model_type_reads_config_json(tmp_path: Path) -> None:
    assert checkpoint_model_type(tmp_path) is None  # no config.json: a bare folder
    assert checkpoint_model_type(tmp_path / "missing") is None
    (tmp_path / "config.json").write_text('{"architectures": ["X"]}')
    assert checkpoint_model_type(tmp_path) is None
    (tmp_path / "config.json").write_text("not json")
    assert checkpoint_model_type(tmp_path) is None
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    assert checkpoint_model_type(tmp_path) == "qwen3_moe"
