"""A delta's changed tensors widened to whole vLLM modules (``served_modules``).

Pure: a stand-in for a Qwen2-MoE-shaped vLLM model's module names and its
``hf_to_vllm_mapper`` (q/k/v stacked into ``qkv_proj``, gate/up into ``gate_up_proj``);
the same widening on vLLM's own models runs in the engines tier.
"""

from __future__ import annotations

from refit_worker.integrations.vllm.served_modules import landing_set, owner, within

STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj"}
STACKED |= {".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}


def stacked(name: str) -> str | None:
    if "rotary_emb" in name:
        return None  # the engine drops it
    for old, new in STACKED.items():
        if old in name:
            return name.replace(old, new, 1)
    return name


def modules(layers: int = 2) -> set[str]:
    names = {"model", "model.embed_tokens", "model.norm", "lm_head", "model.layers"}
    for i in range(layers):
        p = f"model.layers.{i}"
        names |= {p, f"{p}.self_attn", f"{p}.self_attn.qkv_proj", f"{p}.self_attn.o_proj"}
        names |= {f"{p}.input_layernorm", f"{p}.mlp", f"{p}.mlp.gate"}
        names |= {f"{p}.mlp.experts", f"{p}.mlp.experts.routed_experts"}
        names |= {f"{p}.mlp.shared_expert", f"{p}.mlp.shared_expert.gate_up_proj"}
    return names


def checkpoint(layers: int = 2, experts: int = 3) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(layers):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            names += [f"{p}.self_attn.{proj}.weight", f"{p}.self_attn.{proj}.bias"]
        names += [f"{p}.self_attn.o_proj.weight", f"{p}.input_layernorm.weight"]
        names += [f"{p}.mlp.gate.weight", f"{p}.self_attn.rotary_emb.inv_freq"]
        names += [f"{p}.mlp.shared_expert.{w}.weight" for w in ("gate_proj", "up_proj")]
        for e in range(experts):
            names += [f"{p}.mlp.experts.{e}.{w}.weight" for w in ("gate", "up", "down")]
    return names


def test_one_part_of_a_stacked_module_brings_the_others() -> None:
    got = landing_set(checkpoint(), {"model.layers.1.self_attn.k_proj.weight"}, stacked, modules())
    p = "model.layers.1.self_attn"
    assert got.names == {f"{p}.{w}_proj.{k}" for w in "qkv" for k in ("weight", "bias")}
    assert got.modules == {f"{p}.qkv_proj"}


def test_one_expert_brings_its_layers_experts_and_no_other_layers() -> None:
    got = landing_set(
        checkpoint(), {"model.layers.0.mlp.experts.2.down.weight"}, stacked, modules()
    )
    assert got.names == {
        f"model.layers.0.mlp.experts.{e}.{w}.weight"
        for e in range(3)
        for w in ("gate", "up", "down")
    }
    assert got.modules == {"model.layers.0.mlp.experts"}


def test_unfused_modules_and_unchanged_ones() -> None:
    changed = {"model.norm.weight", "model.layers.0.mlp.shared_expert.up_proj.weight"}
    got = landing_set(checkpoint(), changed, stacked, modules())
    shared = "model.layers.0.mlp.shared_expert"
    assert got.names == {
        "model.norm.weight",
        f"{shared}.gate_proj.weight",
        f"{shared}.up_proj.weight",
    }
    assert got.modules == {"model.norm", f"{shared}.gate_up_proj"}
    assert landing_set(checkpoint(), set(), stacked, modules()).names == set()


def test_a_tensor_the_engine_drops_is_its_own_group() -> None:
    inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq"
    assert landing_set(checkpoint(), {inv_freq}, stacked, modules()).names == {inv_freq}
    got = landing_set(checkpoint(), {"model.layers.0.self_attn.o_proj.weight"}, stacked, modules())
    assert got.names == {"model.layers.0.self_attn.o_proj.weight"}


def test_a_mapping_that_does_not_stack_widens_to_the_enclosing_module() -> None:
    # Without the stacking, q_proj has no module of its own: it lands with every tensor
    # of the attention that has none either; o_proj, a module itself, stays out.
    got = landing_set(
        checkpoint(), {"model.layers.0.self_attn.q_proj.weight"}, lambda n: n, modules()
    )
    assert {n.split(".")[-2] for n in got.names} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "rotary_emb",
    }
    assert got.modules == {"model.layers.0.self_attn"}


def test_changed_names_outside_the_checkpoint_are_ignored() -> None:
    assert landing_set(checkpoint(), {"refit.extra.tokens"}, stacked, modules()).names == set()


def test_owner_and_within() -> None:
    assert (
        owner("model.layers.0.mlp.experts.1.up.weight", modules()) == "model.layers.0.mlp.experts"
    )
    assert owner("bias", modules()) is None
    assert owner("top.weight", modules()) is None
    assert within("model.layers.0.mlp.experts.routed_experts", {"model.layers.0.mlp.experts"})
    assert not within("model.layers.0.mlp.experts_x", {"model.layers.0.mlp.experts"})
    assert not within("model.layers.1.mlp.experts", {"model.layers.0.mlp.experts"})
