"""The pure plan of a sharded refit: box geometry, holders, buckets, and what it refuses.

Pure: no process, no NIXL.  The plans are checked by playing them: every rank's block is cut
out of a reference tensor, each piece is copied from its sender's block to the destination,
and the destination must equal the reference, every byte written exactly once.
"""

from __future__ import annotations

import math

import pytest
import torch

from refit_worker.engine.messages.wire import (
    Credit,
    ProtocolError,
    decode,
    encode,
)
from refit_worker.engine.planning.boxes import Box, chunk, intersect, mesh_box, mesh_boxes, runs
from refit_worker.engine.planning.layout import TargetWeightLayout
from refit_worker.engine.planning.shard_plan import (
    MAX_PIECES,
    Holding,
    ShardMeta,
    ShardSpec,
    choose_holders,
    plan_shards,
    receiver_specs,
)
from refit_worker.engine.policy.refit_send import _entry
from refit_worker.engine.rollout.refit_receive import _shard_spec

S0, S1, R = ("shard", 0), ("shard", 1), ("replicate",)


@pytest.mark.parametrize(
    ("size", "parts", "index", "want"),
    [
        (511, 2, 0, (0, 256)),  # uneven: torch.chunk's rule
        (511, 2, 1, (256, 255)),
        (512, 2, 1, (256, 256)),
        (10, 4, 3, (9, 1)),
        (5, 4, 3, (5, 0)),  # a trailing chunk may be empty
        (1, 2, 1, (1, 0)),
        (0, 3, 2, (0, 0)),
    ],
)
def test_chunk_follows_torch_chunk(
    size: int, parts: int, index: int, want: tuple[int, int]
) -> None:
    assert chunk(size, parts, index) == want
    pieces = torch.arange(size).chunk(parts) if size else ()
    if index < len(pieces):  # torch.chunk drops empty trailing chunks
        assert (int(pieces[index][0]) if len(pieces[index]) else size, len(pieces[index])) == want


@pytest.mark.parametrize(
    ("shape", "mesh", "placements", "coord", "want"),
    [
        ((511, 8), (2,), (S0,), (1,), Box((256, 0), (255, 8))),
        ((8, 6), (2,), (S1,), (0,), Box((0, 0), (8, 3))),  # RowwiseParallel weight
        ((8, 6), (2,), (R,), (1,), Box((0, 0), (8, 6))),
        ((8, 6), (2, 2), (S0, S1), (1, 0), Box((4, 0), (4, 3))),  # 2D: rows x columns
        ((8, 6), (2, 2), (R, S0), (1, 1), Box((4, 0), (4, 6))),
        ((8, 6), (2, 2), (S0, S0), (0, 1), Box((2, 0), (2, 6))),  # left to right
        ((7,), (2, 2), (S0, S0), (1, 1), Box((6,), (1,))),  # 4 + 3, then 2 + 2 and 2 + 1
        ((), (2,), (R,), (0,), Box((), ())),
    ],
)
def test_mesh_box(
    shape: tuple[int, ...],
    mesh: tuple[int, ...],
    placements: tuple[tuple[str, int], ...],
    coord: tuple[int, ...],
    want: Box,
) -> None:
    assert mesh_box(shape, mesh, placements, coord) == want


def test_mesh_box_refuses_what_it_cannot_place() -> None:
    with pytest.raises(ValueError, match="shards a dimension"):
        mesh_box((4,), (2,), (S1,), (0,))
    with pytest.raises(ValueError, match="neither"):
        mesh_box((4,), (2,), (("partial",),), (0,))
    with pytest.raises(ValueError, match="one entry per mesh dimension"):
        mesh_box((4,), (2, 2), (S0,), (0, 0))


@pytest.mark.parametrize(
    ("inner", "src", "dst", "want"),
    [
        # Shard(0) into the whole tensor: one run at the block's first row.
        (Box((2, 0), (2, 3)), Box((2, 0), (2, 3)), Box((0, 0), (5, 3)), [(0, 6, 6)]),
        # Shard(1): one run per row, strided in the destination.
        (
            Box((0, 2), (3, 2)),
            Box((0, 2), (3, 2)),
            Box((0, 0), (3, 4)),
            [(0, 2, 2), (2, 6, 2), (4, 10, 2)],
        ),
        # The destination is a slice (a tensor-parallel part) of the source block.
        (Box((1, 0), (2, 2)), Box((0, 0), (4, 2)), Box((1, 0), (2, 2)), [(2, 0, 4)]),
        # 3D, the middle dimension cut: runs over dimension 0, merged over 1..2.
        (
            Box((0, 1, 0), (2, 1, 2)),
            Box((0, 1, 0), (2, 1, 2)),
            Box((0, 0, 0), (2, 2, 2)),
            [(0, 2, 2), (2, 6, 2)],
        ),
        (Box((), ()), Box((), ()), Box((), ()), [(0, 0, 1)]),  # a scalar
        (Box((0,), (0,)), Box((0,), (0,)), Box((0,), (4,)), []),
    ],
)
def test_runs(inner: Box, src: Box, dst: Box, want: list[tuple[int, int, int]]) -> None:
    assert runs(inner, src, dst) == want


def test_intersect() -> None:
    assert intersect(Box((0, 0), (4, 4)), Box((2, 3), (4, 4))) == Box((2, 3), (2, 1))
    assert intersect(Box((0,), (2,)), Box((2,), (2,))) is None
    with pytest.raises(ValueError, match="not inside both"):
        runs(Box((0,), (3,)), Box((0,), (2,)), Box((0,), (3,)))


def test_choose_holders_gives_each_block_one_holder_in_turns() -> None:
    whole = Box((0,), (4,))
    boxes = [(0, whole), (1, whole), (2, whole)]
    assert choose_holders(boxes, receiver=0, index=0) == ((0, whole),)
    assert choose_holders(boxes, receiver=0, index=1) == ((1, whole),)
    assert choose_holders(boxes, receiver=1, index=1) == ((2, whole),)
    halves = [(0, Box((0,), (2,))), (1, Box((2,), (2,))), (2, Box((0,), (2,)))]
    chosen = dict((box, rank) for rank, box in choose_holders(halves, 0, 1))
    assert chosen == {Box((0,), (2,)): 2, Box((2,), (2,)): 1}  # (1 + 0) % 2 of [0, 2]
    assert choose_holders([(0, Box((0,), (0,)))], 0, 0) == ()  # empty blocks: nothing to send


LAYOUTS = {
    # name: (global shape, mesh shape, placements, dtype)
    "fsdp-uneven-vocab": ((511, 24), (2,), (S0,), torch.float32),
    "fsdp-more-ranks-than-rows": ((3, 5), (4,), (S0,), torch.bfloat16),
    "tp-colwise": ((16, 8), (2,), (S0,), torch.float32),
    "tp-rowwise": ((8, 16), (2,), (S1,), torch.float32),
    "tp-rowwise-uneven": ((5, 7), (2,), (S1,), torch.float16),
    "2d-rows-columns": ((9, 10), (2, 2), (S0, S1), torch.float32),
    "2d-replicated-dp": ((12, 4), (2, 2), (R, S0), torch.float32),
    "replicated": ((6, 6), (3,), (R,), torch.int64),
    "bias": ((13,), (2,), (S0,), torch.float32),
    "scalar": ((), (2,), (R,), torch.float32),
    "zero-size": ((0, 4), (2,), (S0,), torch.float32),
}


def _play(
    plan_specs: list[ShardSpec],
    held: list[Holding],
    reference: dict[str, torch.Tensor],
    bucket_size: int,
) -> dict[str, torch.Tensor]:
    """Run the plan by hand: copy every piece from its sender's block into the destination."""
    plan = plan_shards(plan_specs, bucket_size)
    assert plan.senders is not None and len(plan.senders) == len(plan.buckets)
    blocks = {
        (w.name, rank): reference[w.name][
            tuple(slice(o, o + s) for o, s in zip(b.offset, b.size, strict=True))
        ]
        .contiguous()
        .reshape(-1)
        .view(torch.uint8)
        for w in held
        for rank, b in w.boxes
    }
    out, written = {}, {}
    for spec in plan_specs:
        out[spec.name] = torch.zeros(spec.shape, dtype=reference[spec.name].dtype)
        written[spec.name] = torch.zeros(out[spec.name].numel() * out[spec.name].element_size())
    for sender, bucket in zip(plan.senders, plan.buckets, strict=True):
        assert sum(p.chunk_size for p in bucket) <= bucket_size and len(bucket) <= MAX_PIECES
        for piece in bucket:
            assert isinstance(piece, ShardMeta) and piece.source == sender  # one sender a bucket
            src = blocks[(piece.name, sender)]
            dst = out[piece.name].reshape(-1).view(torch.uint8)
            end = piece.chunk_offset + piece.chunk_size
            dst[piece.chunk_offset : end] = src[
                piece.source_offset : piece.source_offset + piece.chunk_size
            ]
            written[piece.name][piece.chunk_offset : end] += 1
    for name, counts in written.items():
        assert bool((counts == 1).all()), f"{name}: every byte exactly once"
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("bucket_size", [64, 1 << 20])
@pytest.mark.parametrize("receiver", [0, 1])
def test_sharded_plan_lands_every_byte_once_at_its_global_place(
    layout: str, bucket_size: int, receiver: int
) -> None:
    shape, mesh, placements, dtype = LAYOUTS[layout]
    ranks = list(range(math.prod(mesh)))
    reference = {"w": torch.arange(math.prod(shape)).reshape(shape).to(dtype)}
    held = [
        Holding(
            "w",
            str(dtype).removeprefix("torch."),
            shape,
            tuple(mesh_boxes(shape, ranks, mesh, placements)),
        )
    ]
    specs = receiver_specs(held, receiver, None)
    out = _play(specs, held, reference, bucket_size)
    assert torch.equal(out["w"], reference["w"])
    plan = plan_shards(specs, bucket_size)
    sent = {r: sum(p.chunk_size for b in plan.buckets for p in b if p.source == r) for r in ranks}
    assert sum(sent.values()) == reference["w"].numel() * reference["w"].element_size()
    if placements == (R,):
        assert len([r for r, n in sent.items() if n]) <= 1  # replicated: one rank sends


def test_a_tensor_parallel_destination_gets_only_its_slice() -> None:
    """A destination box that is a TP slice: FSDP blocks cut to the rows the slice holds."""
    shape = (10, 4)
    held = [
        Holding("l.qkv.weight", "float32", shape, tuple(mesh_boxes(shape, [0, 1, 2], (3,), (S0,))))
    ]
    layout = TargetWeightLayout(tp_rank=1, tp_size=2, tp_dims={r"qkv": 0})
    (spec,) = receiver_specs(held, 0, layout)
    assert spec.shape == (5, 4) and spec.dest == Box((5, 0), (5, 4))
    # FSDP rows 0-3, 4-7, 8-9; the slice's rows 5-9 come from ranks 1 and 2 only.
    assert [rank for rank, _ in spec.sources] == [1, 2]
    reference = torch.arange(40, dtype=torch.float32).reshape(shape)
    out = _play([spec], held, {"l.qkv.weight": reference}, 64)
    assert torch.equal(out["l.qkv.weight"], reference[5:])


def test_the_plan_splits_buckets_by_bytes_and_descriptors() -> None:
    shape = (MAX_PIECES * 2 + 1, 4)  # Shard(1): one piece per row
    held = [Holding("w", "float32", shape, tuple(mesh_boxes(shape, [0, 1], (2,), (S1,))))]
    plan = plan_shards(receiver_specs(held, 0, None), 1 << 30)
    assert plan.senders is not None
    per_sender = {r: plan.senders.count(r) for r in (0, 1)}
    assert per_sender == {0: 3, 1: 3}  # 1025 rows at <= 512 descriptors a WRITE
    assert plan.senders[:2] == (0, 1)  # senders take turns
    big = plan_shards(
        receiver_specs([Holding("b", "uint8", (100,), ((0, Box((0,), (100,))),))], 0, None), 30
    )
    assert [sum(p.chunk_size for p in b) for b in big.buckets] == [30, 30, 30, 10]


@pytest.mark.parametrize(
    ("sources", "match"),
    [
        (((0, Box((0, 0), (3, 4))), (1, Box((2, 0), (2, 4)))), "overlap"),
        (((0, Box((0, 0), (2, 4))),), "cover 8 of the 16"),
        (((0, Box((0,), (4,))),), "wrong rank"),
    ],
)
def test_the_plan_refuses_sources_that_do_not_cover_exactly(
    sources: tuple[tuple[int, Box], ...], match: str
) -> None:
    spec = ShardSpec("w", "float32", (4, 4), offset=(0, 0), sources=sources)
    with pytest.raises(ValueError, match=match):
        plan_shards([spec], 1 << 20)


def test_duplicate_names_are_refused() -> None:
    spec = ShardSpec("w", "float32", (1,), offset=(0,), sources=((0, Box((0,), (1,))),))
    with pytest.raises(ValueError, match="duplicate tensor names"):
        plan_shards([spec, spec], 64)


def test_the_receiver_plans_the_same_from_the_manifest() -> None:
    shape = (511, 8)
    held = [
        Holding("embed", "bfloat16", shape, tuple(mesh_boxes(shape, [0, 1], (2,), (S0,)))),
        Holding("norm", "float32", (8,), ((0, Box((0,), (8,))), (1, Box((0,), (8,))))),
    ]
    specs = receiver_specs(held, 0, None)
    entries = [_entry(spec) for spec in specs]
    assert all(entry.sources is not None for entry in entries)
    again = [_shard_spec(entry) for entry in entries]
    assert again == specs
    assert plan_shards(again, 4096) == plan_shards(specs, 4096)
    # Another layout is another plan: a disagreeing sender is caught by the digest.
    other = receiver_specs(held, 1, None)  # the replicated norm goes to the other holder
    assert plan_shards(other, 4096).digest != plan_shards(specs, 4096).digest


def test_a_peer_of_another_control_version_is_refused_by_name() -> None:
    with pytest.raises(ProtocolError, match="protocol version 3, this worker speaks version 6"):
        decode(b'RFT1{"v":3,"kind":"credit","refit":0,"seq":0,"buffer":0}')
    with pytest.raises(ProtocolError, match="protocol version 2, this worker speaks version 6"):
        decode(b'RFT1{"v":2,"kind":"credit","refit":0,"seq":0,"buffer":0}')
    with pytest.raises(ProtocolError, match="protocol version 1"):
        decode(b'RFT1{"v":1,"kind":"credit","refit":0,"seq":0,"buffer":0}')
    assert decode(encode(Credit(refit=0, seq=0, buffer=0))) == Credit(refit=0, seq=0, buffer=0)
