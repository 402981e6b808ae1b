"""The engine's typed contracts: metadata JSON, control messages, layouts, argument checks.

Pure: no processes, no NIXL agent (the engine constructor validates without one).
"""

from __future__ import annotations

import pytest
import torch

from refit_worker.engine import (
    NIXL_DEFAULT_BACKEND_NAME,
    NIXL_TRANSFER_BUFFER_COUNT,
    NixlAgentMetadata,
    NIXLCheckpointEngine,
    TargetWeightLayout,
    TensorMeta,
    resolve_nixl_backend_kwargs,
)
from refit_worker.engine.messages.wire import (
    BucketReady,
    BufferDesc,
    Credit,
    Digest,
    LandingSet,
    LandingTensor,
    Manifest,
    ManifestEntry,
    ProtocolError,
    Ready,
    decode,
    encode,
)
from refit_worker.engine.planning.layout import WHOLE, Slice, select_slice


def test_constants() -> None:
    assert NIXL_DEFAULT_BACKEND_NAME == "UCX"
    assert NIXL_TRANSFER_BUFFER_COUNT == 2


def test_metadata_round_trips_through_json_exactly() -> None:
    meta = NixlAgentMetadata(
        agent_name="refit-abc",
        agent_metadata=bytes(range(256)) * 3,
        buffers=(BufferDesc(addr=2**47 + 64, length=64 << 20, dev_id=0),),
        layout={"expert_ids": [1, 2]},
    )
    text = meta.model_dump_json()
    assert "\n" not in text and '"addr":140737488355392' in text
    assert NixlAgentMetadata.model_validate_json(text) == meta


def test_metadata_rejects_garbage_base64() -> None:
    with pytest.raises(ValueError, match="agent_metadata"):
        NixlAgentMetadata.model_validate_json('{"agent_name":"a","agent_metadata":"%%%"}')


def test_control_messages_round_trip_and_reject_others() -> None:
    piece = TensorMeta(
        name="w", shape=(2, 3), dtype="bfloat16", chunk_offset=0, chunk_size=12, offset=0
    )
    assert piece.is_whole and piece.nbytes == 12
    message = BucketReady(refit=4, seq=7, buffer=-1, digest="d")
    assert decode(encode(message)) == message
    assert decode(encode(Credit(refit=1, seq=2, buffer=0))) == Credit(refit=1, seq=2, buffer=0)
    landing = LandingSet(
        id="agent:abc",
        metadata=bytes(range(256)),
        tensors=(LandingTensor(name="embed", nbytes=3 << 20, addr=2**47),),
    )
    ready = Ready(refit=1, landing=landing)
    assert decode(encode(ready)) == ready  # NIXL's binary blob survives the JSON framing
    assert decode(encode(Ready(refit=2, landing_id="agent:abc"))).landing_id == "agent:abc"
    digest = Digest(refit=1, seq=3, hashes=(0, 2**64 - 1))
    assert decode(encode(digest)) == digest  # 64-bit hashes survive JSON exactly
    manifest = Manifest(
        refit=0,
        total_buckets=1,
        digest="d",
        bucket_size=64,
        integrity="xxh3_64",
        tensors=(ManifestEntry(name="w", dtype="bfloat16", shape=(2, 3)),),
    )
    assert decode(encode(manifest)) == manifest
    with pytest.raises(ProtocolError, match="invalid control message"):
        decode(encode(manifest).replace(b"xxh3_64", b"crc32"))
    with pytest.raises(ProtocolError, match="not a control message"):
        decode(b"\x80\x04pickle")
    with pytest.raises(ProtocolError, match="invalid control message"):
        decode(b'RFT1{"v":1,"kind":"credit","refit":0,"seq":0,"buffer":0}')  # the old protocol
    with pytest.raises(ProtocolError, match="invalid control message"):
        decode(b'RFT1{"v":2,"kind":"credit","refit":-1,"seq":0,"buffer":0}')


@pytest.mark.parametrize(
    ("layout", "name", "shape", "want"),
    [
        (None, "anything", (4,), WHOLE),
        ({"expert_ids": [1]}, "l.0.experts.1.w", (4,), WHOLE),
        ({"expert_ids": [1]}, "l.0.experts.2.w", (4,), None),
        ({"expert_ids": None}, "l.0.experts.2.w", (4,), WHOLE),
        (
            {"tp_rank": 1, "tp_size": 2, "tp_dims": {"q_proj": 0}},
            "a.q_proj.weight",
            (8, 4),
            Slice(0, 4, 4),
        ),
        (
            {"tp_rank": 1, "tp_size": 2, "tp_dims": {"q_proj": 1}},
            "a.q_proj.weight",
            (8, 4),
            Slice(1, 2, 2),
        ),
        ({"tp_rank": 1, "tp_size": 2, "tp_dims": {"q_proj": 0}}, "a.norm.weight", (8,), WHOLE),
        ({"expert_pattern": r"moe_(?P<expert>\d+)_", "expert_ids": [3]}, "moe_4_w", (1,), None),
        # Declared per name: an uneven part (a padded vocabulary's last rank) wins over tp_dims.
        (
            {"tp_rank": 1, "tp_size": 2, "tp_dims": {"emb": 0}, "slices": {"emb": (0, 32, 60)}},
            "emb",
            (60, 8),
            Slice(0, 32, 28),
        ),
        ({"tp_rank": 1, "tp_size": 2, "slices": {"emb": (0, 32, 60)}}, "norm", (8,), WHOLE),
    ],
)
def test_layout_table(layout, name, shape, want) -> None:
    parsed = TargetWeightLayout.model_validate(layout) if layout is not None else None
    assert select_slice(name, shape, parsed) == want


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        ({"tp_rank": 2, "tp_size": 2}, "tp_rank 2 must be < tp_size 2"),
        ({"expert_pattern": r"experts\.(\d+)"}, "needs a named group"),
        ({"expert_pattern": "("}, "is not a regex"),
        ({"tp_dims": {"x": -1}}, "must be a dimension >= 0"),
        ({"slices": {"x": (0, 5, 4)}}, r"slices\['x'\] = \(0, 5, 4\) needs"),
    ],
)
def test_bad_layouts(layout, match) -> None:
    with pytest.raises(ValueError, match=match):
        TargetWeightLayout.model_validate(layout)


def test_uneven_tp_split_named() -> None:
    layout = TargetWeightLayout(tp_size=3, tp_dims={"q": 0})
    with pytest.raises(ValueError, match=r"'q' dimension 0 \(size 8\) does not split into 3"):
        select_slice("q", (8,), layout)


def test_declared_slice_outside_the_tensor_named() -> None:
    layout = TargetWeightLayout(tp_rank=1, tp_size=2, slices={"emb": (0, 32, 64)})
    with pytest.raises(ValueError, match=r"'emb' with shape \(60, 8\) has no part \[32, 64\)"):
        select_slice("emb", (60, 8), layout)


def test_resolve_backend_kwargs() -> None:
    assert resolve_nixl_backend_kwargs({}) == ("UCX", None)
    assert resolve_nixl_backend_kwargs(
        {"backend_name": "UCX", "backend_init_params": {"num_workers": 1}}
    ) == ("UCX", {"num_workers": 1})
    with pytest.raises(ValueError, match=r"unknown nixl kwargs \['backend'\]"):
        resolve_nixl_backend_kwargs({"backend": "UCX"})
    with pytest.raises(ValueError, match="backend_name must be a non-empty string, got ''"):
        resolve_nixl_backend_kwargs({"backend_name": ""})


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0,), {"device": "cpu"}, "bucket_size must be > 0 bytes, got 0"),
        ((1024,), {"device": "mps"}, "device must be 'cpu' or 'cuda', got 'mps'"),
        ((1024,), {"device": "cpu", "timeout_s": 0}, "timeout_s must be > 0 seconds, got 0"),
        ((1024,), {"device": "cpu", "buffer_count": 1}, "buffer_count must be an int >= 2"),
    ],
)
def test_engine_rejects_bad_arguments(args, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        NIXLCheckpointEngine(*args, **kwargs)


def test_cuda_engine_needs_cuda() -> None:
    if torch.cuda.is_available():
        assert NIXLCheckpointEngine(1024, device="cuda").device.type == "cuda"
    else:
        with pytest.raises(ValueError, match="'cuda' requested but CUDA is not available"):
            NIXLCheckpointEngine(1024, device="cuda")


async def test_engine_refuses_to_send_before_init() -> None:
    engine = NIXLCheckpointEngine(1024, device="cpu")
    with pytest.raises(RuntimeError, match="call init_policy_process_group"):
        await engine.send_weights(iter([]))
    assert engine.get_target_weight_layout() is None
    engine.set_target_weight_layout(TargetWeightLayout(expert_ids=(1,)))
    assert engine.get_target_weight_layout() is None  # only with shard_expert_weights=True
    # A declaration of tensor-parallel slices always travels: the rank holds only those.
    engine.set_target_weight_layout(TargetWeightLayout(tp_size=2, slices={"w": (0, 0, 2)}))
    assert engine.get_target_weight_layout()["slices"] == {"w": [0, 0, 2]}
