"""The tensor-parallel declaration from a description of vLLM's layers (no vLLM here)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from refit_worker.integrations.vllm.tp_slices import (
    Served,
    Sharding,
    check_layer,
    declare,
    local_shape,
    part_of,
)

L = "model.layers.0"
# A Qwen2 of 8 query heads over 2 KV heads (head_dim 32), MLP 256, vocabulary 60 padded
# to 64: as vLLM's layers describe it on each of 2 ranks.
SERVED = {
    f"{L}.self_attn.q_proj.weight": Served(f"{L}.self_attn.qkv_proj", "weight", 0),
    f"{L}.self_attn.k_proj.weight": Served(f"{L}.self_attn.qkv_proj", "weight", 1),
    f"{L}.self_attn.v_proj.bias": Served(f"{L}.self_attn.qkv_proj", "bias", 2),
    f"{L}.self_attn.o_proj.weight": Served(f"{L}.self_attn.o_proj", "weight"),
    f"{L}.mlp.gate_proj.weight": Served(f"{L}.mlp.gate_up_proj", "weight", 0),
    f"{L}.mlp.up_proj.weight": Served(f"{L}.mlp.gate_up_proj", "weight", 1),
    f"{L}.mlp.down_proj.weight": Served(f"{L}.mlp.down_proj", "weight"),
    f"{L}.input_layernorm.weight": Served(f"{L}.input_layernorm", "weight"),
    "model.embed_tokens.weight": Served("model.embed_tokens", "weight"),
    "unused.weight": None,
}


def layers(rank: int, tp: int = 2, kv_replicas: int = 1) -> dict[str, Sharding]:
    vocab = [(0, 32), (32, 60)][rank] if tp == 2 else (0, 60)
    return {
        f"{L}.self_attn.qkv_proj": Sharding(
            "column", 0, rank, tp, sizes=(256, 64, 64), replicas=(1, kv_replicas, kv_replicas)
        ),
        f"{L}.self_attn.o_proj": Sharding("row", 1, rank, tp, sizes=(256,)),
        f"{L}.mlp.gate_up_proj": Sharding("column", 0, rank, tp, sizes=(256, 256)),
        f"{L}.mlp.down_proj": Sharding("row", 1, rank, tp, sizes=(256,)),
        f"{L}.input_layernorm": Sharding("whole", 0, rank, tp),
        "model.embed_tokens": Sharding("vocab", 0, rank, tp, rows=vocab),
    }


def test_two_ranks_hold_complementary_parts() -> None:
    first, second = declare(SERVED, layers(0)), declare(SERVED, layers(1))
    assert first[f"{L}.self_attn.q_proj.weight"] == (0, 0, 128)
    assert second[f"{L}.self_attn.q_proj.weight"] == (0, 128, 256)
    assert second[f"{L}.self_attn.k_proj.weight"] == (0, 32, 64)
    assert second[f"{L}.self_attn.v_proj.bias"] == (0, 32, 64)
    assert second[f"{L}.self_attn.o_proj.weight"] == (1, 128, 256)
    assert first[f"{L}.mlp.up_proj.weight"] == (0, 0, 128)
    assert second[f"{L}.mlp.down_proj.weight"] == (1, 128, 256)
    # The padded vocabulary: the last rank holds fewer real rows.
    assert first["model.embed_tokens.weight"] == (0, 0, 32)
    assert second["model.embed_tokens.weight"] == (0, 32, 60)
    # Norms whole; a tensor the engine does not serve is not declared.
    assert f"{L}.input_layernorm.weight" not in first and "unused.weight" not in first


def test_kv_heads_replicated_over_ranks() -> None:
    # 2 KV heads over 4 ranks: ranks 0, 1 hold head 0, ranks 2, 3 head 1.
    parts = [declare(SERVED, layers(r, tp=4, kv_replicas=2)) for r in range(4)]
    keys = [p[f"{L}.self_attn.k_proj.weight"] for p in parts]
    assert keys == [(0, 0, 32), (0, 0, 32), (0, 32, 64), (0, 32, 64)]
    assert [p[f"{L}.self_attn.q_proj.weight"][1] for p in parts] == [0, 64, 128, 192]


def test_one_rank_declares_nothing() -> None:
    assert declare(SERVED, layers(0, tp=1)) == {}


def test_row_bias_whole_and_local_shape() -> None:
    row = Sharding("row", 1, 1, 2, sizes=(256,))
    assert part_of("o.bias", Served("o", "bias"), row) is None
    assert local_shape((256, 256), (1, 128, 256)) == (256, 128)
    assert local_shape((8,), None) == (8,)


@pytest.mark.parametrize(
    ("sharding", "served", "match"),
    [
        (Sharding("column", 0, 0, 2, sizes=(3,)), Served("x", "weight"), "3 rows do not split"),
        (Sharding("column", 0, 0, 2, sizes=(4,)), Served("x", "w", 1), "part 1 of a layer of 1"),
        (Sharding("row", 1, 0, 2, sizes=(5,)), Served("x", "weight"), "5 columns do not split"),
    ],
)
def test_bad_descriptions_named(sharding: Sharding, served: Served, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        part_of("x.weight", served, sharding)


def test_experts_split_by_their_intermediate_rows() -> None:
    experts = Sharding("experts", 0, 1, 2, sizes=(64,))
    gate = part_of("e.3.gate_proj.weight", Served("experts", "w13"), experts)
    down = part_of("e.3.down_proj.weight", Served("experts", "w2"), experts)
    assert (gate, down) == ((0, 32, 64), (1, 32, 64))


def test_parts_must_fill_what_vllm_holds() -> None:
    qkv = Sharding("column", 0, 1, 2, sizes=(256, 64, 64), local=192)
    check_layer("qkv", qkv)  # 128 + 32 + 32
    check_layer("emb", Sharding("vocab", 0, 1, 2, rows=(32, 60), local=32))  # padded
    with pytest.raises(ValueError, match=r"'qkv': its column parts take 192 .* vLLM holds 160"):
        check_layer("qkv", replace(qkv, local=160))
    with pytest.raises(ValueError, match="row parts take 128"):
        declare(SERVED, {**layers(1), "o": Sharding("row", 1, 1, 2, sizes=(256,), local=64)})
