"""Delta refits, pure parts: encoding the changed elements, checking and applying them onto
a spare copy, the whole-state check, and the gang's verdict when a member wants a refit
whole.  Several dtypes and layouts, since the codec works on bits, not values."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from refit_worker.engine.delta.codec import (
    DELTA_TENSOR,
    DeltaArena,
    DeltaRejectedError,
    apply_delta,
    check_delta,
    encode_delta,
    scatter_changes,
    worth_sending,
)
from refit_worker.engine.messages.integrity import tensors_digest
from refit_worker.engine.messages.wire import (
    Decline,
    DeltaEntry,
    DeltaHeader,
    Manifest,
    decode,
    encode,
)
from refit_worker.pod.weights import advance
from refit_worker.policy.delta_source import PROBE_EVERY, DeltaSource, prefer_delta
from refit_worker.policy.gang_plan import fold_verdict

Named = dict[str, torch.Tensor]


def _model(seed: int = 0) -> Named:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=gen).to(torch.bfloat16),
        "layers.0.mlp.experts.w1": torch.randn(4, 16, 8, generator=gen),  # fp32, 3-d (MoE)
        "layers.0.norm.weight": torch.randn(32, generator=gen).to(torch.float16),
        "quant.scale": (torch.randn(40, generator=gen) * 16).to(torch.int8),
        "mask": torch.rand(17, generator=gen) > 0.5,
        "empty": torch.empty(0, 3),
    }


def _clone(named: Named) -> Named:
    return {n: t.clone() for n, t in named.items()}


def _equal_bits(a: Named, b: Named) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype
        and a[n].shape == b[n].shape
        and torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))
        for n in a
    )


def _step(named: Named, share: float, step: int) -> Named:
    after = _clone(named)
    advance(after, step, share)
    return after


def _changed_since(before: Named, after: Named) -> int:
    return sum(
        int(
            (
                b.reshape(-1).view(torch.uint8).view(-1, b.element_size())
                != a.reshape(-1).view(torch.uint8).view(-1, b.element_size())
            )
            .any(dim=1)
            .sum()
        )
        for b, a in ((before[n], after[n]) for n in before)
        if b.numel()
    )


def _roundtrip(base: Named, after: Named) -> tuple[Named, str]:
    delta = encode_delta(after, base, DeltaArena())
    header = delta.header(1, tensors_digest(base), tensors_digest(after))
    spare = {n: torch.full_like(t, 0) for n, t in base.items()}
    return spare, apply_delta(header, delta.data, base, spare)


@pytest.mark.parametrize("share", [0.01, 0.25, 1.0])
def test_a_delta_applied_onto_its_base_gives_the_new_bits_and_their_digest(share: float) -> None:
    base = _model()
    after = _step(base, share, 3)
    spare, digest = _roundtrip(base, after)
    assert _equal_bits(spare, after)
    assert digest == tensors_digest(after) != tensors_digest(base)


def test_the_delta_holds_only_changed_elements_and_compares_bits_not_values() -> None:
    base = {"w": torch.tensor([0.0, 1.0, float("nan"), 2.0, 3.0], dtype=torch.float32)}
    after = {"w": torch.tensor([-0.0, 1.0, float("nan"), 2.5, 3.0], dtype=torch.float32)}
    delta = encode_delta(after, base, DeltaArena())
    (entry,) = delta.entries
    # -0.0 differs from 0.0 in its bits; the same NaN does not differ from itself.
    assert (entry.name, entry.count, entry.index_dtype) == ("w", 2, "int32")
    assert delta.changed == 2 and delta.total == 5
    spare, _ = _roundtrip(base, after)
    assert _equal_bits(spare, after)


def test_an_unchanged_state_gives_an_empty_delta_that_still_checks_the_digest() -> None:
    base = _model()
    delta = encode_delta(_clone(base), base, DeltaArena())
    assert delta.entries == () and delta.nbytes == 0
    spare, digest = _roundtrip(base, _clone(base))
    assert _equal_bits(spare, base) and digest == tensors_digest(base)


def test_a_delta_whose_result_is_not_the_trainers_is_rejected_and_the_base_kept() -> None:
    base = _model()
    kept = _clone(base)
    after = _step(base, 0.1, 2)
    delta = encode_delta(after, base, DeltaArena())
    header = delta.header(1, tensors_digest(base), tensors_digest(after))
    entry = delta.entries[0]
    delta.data[entry.values_offset] ^= 0x40  # one flipped bit in a value
    spare = {n: torch.zeros_like(t) for n, t in base.items()}
    with pytest.raises(DeltaRejectedError, match="the trainer's is"):
        apply_delta(header, delta.data, base, spare)
    assert _equal_bits(base, kept)  # the served copy is untouched


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda e, h: {"entries": (e.model_copy(update={"name": "nope"}),)}, "which the base"),
        (lambda e, h: {"entries": (e.model_copy(update={"dtype": "bfloat16"}),)}, "the delta is"),
        (lambda e, h: {"entries": (e, e)}, "twice"),
        (lambda e, h: {"nbytes": h.nbytes + 8}, "its header says"),
        (lambda e, h: {"entries": (e.model_copy(update={"count": e.count + 1000}),)}, "outside"),
        (lambda e, h: {"entries": (e.model_copy(update={"offset": e.offset + 1}),)}, "outside"),
    ],
)
def test_a_malformed_delta_is_refused_before_anything_is_written(
    tamper: Callable[[DeltaEntry, DeltaHeader], dict[str, object]], message: str
) -> None:
    base = {"w": torch.arange(100, dtype=torch.float32)}
    after = _step(base, 0.1, 1)
    delta = encode_delta(after, base, DeltaArena())
    header = delta.header(0, tensors_digest(base), tensors_digest(after))
    bad = header.model_copy(update=tamper(header.entries[0], header))
    data = delta.data
    spare = {"w": torch.full((100,), 7.0)}
    with pytest.raises(DeltaRejectedError, match=message):
        apply_delta(bad, data, base, spare)
    assert torch.equal(spare["w"], torch.full((100,), 7.0))  # nothing written


def test_an_index_outside_the_tensor_is_refused() -> None:
    base = {"w": torch.zeros(10)}
    after = {"w": torch.ones(10)}
    delta = encode_delta(after, base, DeltaArena())
    header = delta.header(0, tensors_digest(base), tensors_digest(after))
    entry = header.entries[0]
    delta.data[entry.offset : entry.offset + 4].view(torch.int32)[0] = 10
    with pytest.raises(DeltaRejectedError, match="outside its 10 elements"):
        check_delta(header, delta.data, base)


def test_encoding_refuses_weights_whose_layout_changed_since_the_base() -> None:
    with pytest.raises(ValueError, match="changed their names"):
        encode_delta({"a": torch.zeros(2)}, {"b": torch.zeros(2)}, DeltaArena())
    with pytest.raises(ValueError, match="dtype or shape"):
        encode_delta({"a": torch.zeros(2)}, {"a": torch.zeros(3)}, DeltaArena())


def test_the_arena_keeps_its_memory_while_deltas_fit() -> None:
    arena = DeltaArena()
    first = arena.take(1000, torch.device("cpu"))
    again = arena.take(800, torch.device("cpu"))
    assert again.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    bigger = arena.take(10**6, torch.device("cpu"))
    assert bigger.numel() == 10**6


def test_a_delta_is_sent_only_while_it_is_at_most_half_the_whole() -> None:
    assert worth_sending(50, 100) and not worth_sending(51, 100)


def test_the_source_offers_whole_first_then_deltas_onto_what_it_sent() -> None:
    source = DeltaSource(rank=0)
    state = _model()
    first = source.offer(list(state.items()), 0)
    assert first.header is None and first.digest == tensors_digest(state)
    source.sent(0, list(state.items()), first)
    advance(state, 1, 0.01)
    second = source.offer(list(state.items()), 1)
    assert second.header is not None and second.items[0][0] == DELTA_TENSOR
    assert (second.header.base_refit, second.header.base_digest) == (0, first.digest)
    assert second.header.digest == tensors_digest(state)
    # Every element changed: the delta would outweigh the refit, so it goes whole.
    source.sent(1, list(state.items()), second)
    advance(state, 2)
    assert source.offer(list(state.items()), 2).header is None


def test_deltas_in_a_row_each_apply_onto_the_last_one_sent() -> None:
    # The source brings its copy up by the delta's own elements after each send: were it
    # left behind by one element, the next delta would not reproduce the trainer's bits.
    source, state = DeltaSource(rank=0), _model()
    first = source.offer(list(state.items()), 0)
    source.sent(0, list(state.items()), first)
    served = _clone(state)
    for refit in range(1, 5):
        advance(state, refit, 0.02)
        offer = source.offer(list(state.items()), refit)
        assert offer.header is not None and offer.header.base_refit == refit - 1
        # Exactly the elements that changed since the last send, not since an older one.
        assert offer.delta is not None and offer.delta.changed == _changed_since(served, state)
        spare = {n: torch.zeros_like(t) for n, t in served.items()}
        apply_delta(
            offer.header, offer.delta.data if offer.delta else torch.empty(0), served, spare
        )
        assert _equal_bits(spare, state)
        source.sent(refit, list(state.items()), offer)
        served = spare


def test_scattered_changes_keep_the_bits_of_signed_zeros_and_nans() -> None:
    nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)  # a NaN payload
    base = {"w": torch.tensor([0.0, 1.0, 2.0, 3.0]), "b": torch.ones(3, dtype=torch.bfloat16)}
    after = {"w": torch.cat([torch.tensor([-0.0, 1.0]), nan, torch.tensor([3.0])]), "b": base["b"]}
    delta = encode_delta(after, base, DeltaArena())
    copy = _clone(base)
    scatter_changes(delta, copy)
    assert _equal_bits(copy, after) and delta.compared == {"w", "b"}


def test_the_messages_carry_the_delta_and_the_wish_for_a_whole_refit() -> None:
    base = {"w": torch.zeros(8)}
    after = {"w": torch.arange(8, dtype=torch.float32)}
    delta = encode_delta(after, base, DeltaArena())
    header = delta.header(4, tensors_digest(base), tensors_digest(after))
    manifest = Manifest(
        refit=5,
        total_buckets=1,
        digest="d",
        bucket_size=1 << 20,
        tensors=(),
        delta=header,
    )
    assert decode(encode(manifest)) == manifest
    decline = Decline(refit=5, reason="it serves refit 3", whole=True)
    assert decode(encode(decline)) == decline


def test_the_gang_sends_again_while_a_rank_owes_a_member_the_whole_refit() -> None:
    settled, past, resend = 1, 2, 4
    assert fold_verdict([settled, 0]).settled
    assert not fold_verdict([settled, resend]).settled  # another round, on every rank
    assert not fold_verdict([settled | resend]).settled
    assert fold_verdict([settled | resend | past]).settled  # time is up: it stands
    assert not fold_verdict([resend | past]).settled  # delivered nowhere: undelivered


@pytest.mark.parametrize("share", [0.01, 0.1])
def test_a_synthetic_step_changes_the_share_of_elements_asked_for(share: float) -> None:
    state = {"w": torch.randn(10_000).to(torch.bfloat16), "q": torch.zeros(1000, dtype=torch.int8)}
    after = _step(state, share, 5)
    for name, before in state.items():
        changed = (before.view(-1) != after[name].view(-1)).float().mean().item()
        assert abs(changed - share) < share / 5, (name, changed)


def test_auto_sends_deltas_only_while_they_were_faster_and_tries_again_later() -> None:
    assert prefer_delta("on", whole_s=0.1, delta_s=0.5, since=0)  # on: always
    assert prefer_delta("auto", whole_s=None, delta_s=None, since=0)  # nothing measured yet
    assert prefer_delta("auto", whole_s=0.5, delta_s=0.1, since=0)
    assert not prefer_delta("auto", whole_s=0.1, delta_s=0.5, since=PROBE_EVERY - 1)
    assert prefer_delta("auto", whole_s=0.1, delta_s=0.5, since=PROBE_EVERY)


def test_auto_goes_whole_after_a_slow_delta_without_encoding_one() -> None:
    source = DeltaSource(rank=0, mode="auto")
    state = _model()
    source.sent(0, list(state.items()), source.offer(list(state.items()), 0))
    advance(state, 1, 0.01)
    delta = source.offer(list(state.items()), 1)
    assert delta.header is not None
    source._whole_s = 0.0  # a whole refit measured faster than any delta can be
    source.sent(1, list(state.items()), delta)
    advance(state, 2, 0.01)
    whole = source.offer(list(state.items()), 2)
    assert whole.header is None and whole.delta is None  # not even encoded
    assert whole.digest == tensors_digest(state)
