"""Sharded delta refits, pure parts: each policy rank encodes the changes of its own
blocks, the pieces are laid end to end, and the receiver applies them onto its whole
tensors and checks every block's hash.  Shown on FSDP2-style row shards, tensor-parallel
column shards, a 2-D mesh with uneven blocks, and replicated tensors, against the whole
tensors the trainer would hold."""

from __future__ import annotations

import pytest
import torch

from refit_worker.engine.delta.blocks import (
    block_ref,
    block_view,
    blocks_digest,
    check_blocks,
    encoded_here,
    global_index,
    hash_blocks,
    merge_hashes,
    merge_pieces,
)
from refit_worker.engine.delta.codec import (
    Delta,
    DeltaArena,
    DeltaRejectedError,
    apply_delta,
    encode_delta,
)
from refit_worker.engine.messages.integrity import tensors_digest
from refit_worker.engine.messages.wire import BlockHash, DeltaHeader
from refit_worker.engine.planning.boxes import Box, Placement, mesh_boxes
from refit_worker.pod.weights import advance
from refit_worker.policy.delta_agreement import RankOffer, fold_offers

Named = dict[str, torch.Tensor]
#: name -> (mesh shape, placements) over the policy ranks 0..3 of a 2x2 mesh or a 4-rank one.
Layout = dict[str, tuple[tuple[int, ...], list[Placement]]]

FSDP: Layout = {  # Shard(0) over 4 ranks; uneven rows (10 over 4: 3,3,3,1)
    "embed.weight": ((4,), [("shard", 0)]),
    "layers.0.mlp.w1": ((4,), [("shard", 0)]),
    "norm.weight": ((4,), [("shard", 0)]),
}
TP: Layout = {  # column and row parallel over 4 ranks, the norm replicated
    "embed.weight": ((4,), [("shard", 1)]),
    "layers.0.mlp.w1": ((4,), [("shard", 0)]),
    "norm.weight": ((4,), [("replicate",)]),
}
MESH_2D: Layout = {  # FSDP over dim 0 x TP over dim 1 on a 2x2 mesh; the norm TP-replicated
    "embed.weight": ((2, 2), [("shard", 0), ("shard", 1)]),
    "layers.0.mlp.w1": ((2, 2), [("shard", 1), ("shard", 0)]),
    "norm.weight": ((2, 2), [("shard", 0), ("replicate",)]),
}


def _model(seed: int = 0) -> Named:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(10, 6, generator=gen).to(torch.bfloat16),
        "layers.0.mlp.w1": torch.randn(3, 7, 5, generator=gen),  # fp32, 3-d (MoE experts)
        "norm.weight": torch.randn(9, generator=gen).to(torch.float16),
    }


def _rank_blocks(model: Named, layout: Layout) -> dict[int, dict[str, tuple[Box, bool]]]:
    """Every rank's box of every tensor, and whether it encodes that box's changes."""
    out: dict[int, dict[str, tuple[Box, bool]]] = {r: {} for r in range(4)}
    for index, (name, (mesh, placements)) in enumerate(sorted(layout.items())):
        boxes = mesh_boxes(tuple(model[name].shape), range(4), mesh, placements)
        for rank, box in boxes:
            out[rank][name] = (box, encoded_here(boxes, rank, index))
    return out


def _rank_deltas(
    before: Named, after: Named, layout: Layout
) -> list[tuple[Delta, list[BlockHash], int]]:
    """Per rank, as :meth:`DeltaSource.offer_sharded` finds it: the delta of the blocks it
    encodes, the hashes of all its blocks, and the bytes of the blocks it encodes."""
    boxes = _rank_blocks(before, layout)
    found = []
    for rank in range(4):
        refs = {n: block_ref(before[n].shape, b) for n, (b, _) in boxes[rank].items()}
        now = {n: block_view(after[n], r).contiguous() for n, r in refs.items()}
        then = {n: block_view(before[n], r).contiguous() for n, r in refs.items()}
        mine = [n for n, (_, encodes) in boxes[rank].items() if encodes]
        delta = encode_delta(
            {n: now[n] for n in mine}, {n: then[n] for n in mine}, DeltaArena(), refs
        )
        whole = sum(now[n].numel() * now[n].element_size() for n in mine)
        found.append((delta, hash_blocks(now, refs, "xxh3_64"), whole))
    return found


def _sharded_delta(before: Named, after: Named, layout: Layout) -> tuple[DeltaHeader, torch.Tensor]:
    """What the four ranks send together: each encodes its own blocks, hashes them, and the
    pieces and hashes are merged as the gang merges them."""
    ranks = _rank_deltas(before, after, layout)
    entries, starts, total = merge_pieces([(d.entries, d.nbytes) for d, _, _ in ranks])
    data = torch.zeros(total, dtype=torch.uint8)
    for start, (delta, _, _) in zip(starts, ranks, strict=True):
        data[start : start + delta.nbytes] = delta.data
    blocks = merge_hashes([hashes for _, hashes, _ in ranks])
    header = DeltaHeader(
        base_refit=3,
        base_digest="xxh3_64/blocks:0000000000000000",
        digest=blocks_digest("xxh3_64", blocks),
        nbytes=total,
        entries=entries,
        blocks=blocks,
    )
    return header, data


def _equal_bits(a: Named, b: Named) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))
        for n in a
    )


@pytest.mark.parametrize("layout", [FSDP, TP, MESH_2D], ids=["fsdp-rows", "tp", "mesh-2d"])
@pytest.mark.parametrize("share", [0.02, 0.3])
def test_the_ranks_pieces_applied_onto_whole_tensors_give_the_trainers_bits(
    layout: Layout, share: float
) -> None:
    before = _model()
    after = {n: t.clone() for n, t in before.items()}
    advance(after, 5, share)
    header, data = _sharded_delta(before, after, layout)
    assert header.entries, "the step changed nothing: the test would prove nothing"
    spare = {n: torch.zeros_like(t) for n, t in before.items()}
    digest = apply_delta(header, data, before, spare)
    assert _equal_bits(spare, after)
    assert digest == header.digest
    assert tensors_digest(spare) == tensors_digest(after)


def test_a_replicated_block_is_listed_once_and_a_sharded_one_per_holder() -> None:
    before = _model()
    header, _ = _sharded_delta(before, before, TP)
    counts = {n: sum(h.name == n for h in header.blocks or ()) for n in before}
    # torch.chunk's split: 6 columns and 3 experts over 4 ranks leave the last rank an
    # empty block, which holds nothing to hash; the rest still cover every element.
    assert counts == {"embed.weight": 3, "layers.0.mlp.w1": 3, "norm.weight": 1}
    check_blocks(header.blocks or (), before)


def test_a_flipped_byte_in_one_ranks_piece_is_rejected_naming_its_block() -> None:
    before = _model()
    after = {n: t.clone() for n, t in before.items()}
    advance(after, 7, 0.05)
    header, data = _sharded_delta(before, after, MESH_2D)
    entry = header.entries[-1]
    data[entry.values_offset] ^= 0x40
    served = {n: t.clone() for n, t in before.items()}
    with pytest.raises(DeltaRejectedError, match=rf"first differing: '{entry.name}' block"):
        apply_delta(header, data, served, {n: torch.zeros_like(t) for n, t in before.items()})
    assert _equal_bits(served, before)


def test_the_base_must_match_everywhere_not_only_where_the_delta_writes() -> None:
    before = _model()
    after = {n: t.clone() for n, t in before.items()}
    advance(after, 2, 0.02)
    header, data = _sharded_delta(before, after, FSDP)
    written = {(e.name, e.block.offset if e.block else ()) for e in header.entries}
    drifted = {n: t.clone() for n, t in before.items()}
    untouched = next(h for h in header.blocks or () if (h.name, h.block.offset) not in written)
    block_view(drifted[untouched.name], untouched.block).reshape(-1)[0] += 1
    with pytest.raises(DeltaRejectedError, match=untouched.name):
        apply_delta(header, data, drifted, {n: torch.zeros_like(t) for n, t in before.items()})


def test_overlapping_or_missing_blocks_are_refused_before_anything_is_written() -> None:
    before = _model()
    after = {n: t.clone() for n, t in before.items()}
    advance(after, 4, 0.3)
    header, data = _sharded_delta(before, after, FSDP)
    first = next(e for e in header.entries if e.block is not None)
    twice = header.model_copy(update={"entries": (*header.entries, first)})
    with pytest.raises(DeltaRejectedError, match="twice"):
        apply_delta(twice, data, before, {n: torch.zeros_like(t) for n, t in before.items()})
    short = header.model_copy(update={"blocks": (header.blocks or ())[1:]})
    with pytest.raises(DeltaRejectedError, match="cover"):
        apply_delta(short, data, before, {n: torch.zeros_like(t) for n, t in before.items()})


def test_replicas_that_drifted_apart_are_named() -> None:
    ref = block_ref((9,), Box((0,), (9,)))
    a = BlockHash(name="norm.weight", dtype="float16", block=ref, hash=1)
    with pytest.raises(ValueError, match=r"norm\.weight.*different bytes"):
        merge_hashes([[a], [a.model_copy(update={"hash": 2})]])
    assert merge_hashes([[a], [a]]) == (a,)


@pytest.mark.parametrize(
    ("shape", "box"),
    [
        ((10, 6), Box((3, 0), (3, 6))),
        ((10, 6), Box((0, 2), (10, 2))),
        ((3, 7, 5), Box((1, 2, 1), (2, 4, 3))),
        ((4, 3, 2), Box((1, 0, 0), (2, 3, 2))),  # whole rows: the offset-only path
        ((9,), Box((4,), (5,))),
        ((), Box((), ())),
    ],
)
def test_block_indices_map_to_the_global_tensors(shape: tuple[int, ...], box: Box) -> None:
    numbered = torch.arange(max(1, torch.Size(shape).numel())).reshape(shape)
    block = block_ref(shape, box)
    local = torch.arange(box.numel)
    expected = block_view(numbered, block).reshape(-1)[local]
    assert torch.equal(global_index(local, block), expected)


def test_merged_pieces_keep_each_ranks_entries_inside_its_own_bytes() -> None:
    before = _model()
    after = {n: t.clone() for n, t in before.items()}
    advance(after, 9, 0.3)
    header, data = _sharded_delta(before, after, TP)
    ends = sorted((e.offset, e.values_offset) for e in header.entries)
    assert all(o % 8 == 0 and v % 8 == 0 for o, v in ends)
    assert len({e.offset for e in header.entries}) == len(header.entries)
    assert header.nbytes == data.numel()


def _offers(before: Named, after: Named, layout: Layout, *, bases: list[int]) -> list[RankOffer]:
    """Each rank's offer as :meth:`DeltaSource.offer_sharded` builds it (base refit per rank)."""
    return [
        RankOffer(
            can=True,
            base_refit=base,
            base_digest=f"xxh3_64/blocks:{base:016x}",
            nbytes=delta.nbytes,
            entries=delta.entries,
            changed=delta.changed,
            total=delta.total,
            whole=whole,
            hashes=tuple(hashes),
        )
        for base, (delta, hashes, whole) in zip(
            bases, _rank_deltas(before, after, layout), strict=True
        )
    ]


def test_the_gang_agrees_on_one_delta_when_every_rank_can_and_it_pays() -> None:
    before = _model()
    after = {n: t.clone() for n, t in before.items()}
    advance(after, 3, 0.05)
    offers = _offers(before, after, MESH_2D, bases=[3, 3, 3, 3])
    gang = fold_offers(offers, "xxh3_64")
    assert gang.header is not None and gang.why_whole == ""
    assert gang.total == sum(t.numel() for t in before.values()), "every element once"
    assert [box.size[0] for _, box in gang.pieces] == [o.nbytes for o in offers]
    spare = {n: torch.zeros_like(t) for n, t in before.items()}
    data = torch.zeros(gang.header.nbytes, dtype=torch.uint8)  # no change sent: rejected
    with pytest.raises(DeltaRejectedError):
        apply_delta(gang.header, data, before, spare)


@pytest.mark.parametrize(
    ("change", "bases", "unable", "why"),
    [
        (0.05, [3, 3, 2, 3], None, "different bases"),
        (0.05, [3, 3, 3, 3], 1, "policy ranks [1] hold no base"),
        (1.0, [3, 3, 3, 3], None, "100.0% of the elements changed"),
    ],
)
def test_the_gang_sends_whole_when_one_rank_cannot_or_a_delta_would_not_pay(
    change: float, bases: list[int], unable: int | None, why: str
) -> None:
    before = _model()
    after = {n: t.clone() for n, t in before.items()}
    advance(after, 3, change)
    offers = _offers(before, after, FSDP, bases=bases)
    if unable is not None:
        offers[unable] = RankOffer(can=False, hashes=offers[unable].hashes)
    gang = fold_offers(offers, "xxh3_64")
    assert gang.header is None and gang.pieces == ()
    assert why in gang.why_whole
    # The version's digest is the same either way: the blocks of the weights sent.
    assert gang.digest == fold_offers(_offers(before, after, FSDP, bases=[3] * 4), "xxh3_64").digest
