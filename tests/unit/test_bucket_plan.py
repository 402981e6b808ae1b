"""Bucket planning, table-tested.  Pure: no processes, no NIXL."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refit_worker.engine.planning.buckets import (
    TensorSpec,
    buffer_handoffs,
    buffer_slots,
    cached_plan,
    check_bucket_size,
    lands,
    plan_buckets,
    plan_digest,
)


def layout(buckets):
    """(name, chunk_offset, chunk_size, offset) per bucket, for compact expectations."""
    return [[(p.name, p.chunk_offset, p.chunk_size, p.offset) for p in b] for b in buckets]


F32 = "float32"
BF16 = "bfloat16"


@pytest.mark.parametrize(
    ("specs", "bucket", "want"),
    [
        pytest.param([], 64, [[]], id="empty-input-one-empty-bucket"),
        pytest.param([TensorSpec("a", F32, (4,))], 64, [[("a", 0, 16, 0)]], id="one-fits"),
        pytest.param(
            [TensorSpec("a", "int8", (3,)), TensorSpec("b", F32, (2,))],
            64,
            [[("a", 0, 3, 0), ("b", 0, 8, 4)]],
            id="aligned-to-element-size",
        ),
        pytest.param(
            [TensorSpec("a", F32, (10,)), TensorSpec("b", F32, (10,))],
            64,
            [[("a", 0, 40, 0)], [("b", 0, 40, 0)]],
            id="new-bucket-rather-than-split",
        ),
        pytest.param(
            [TensorSpec("a", F32, (40,))],
            64,
            [[("a", 0, 64, 0)], [("a", 64, 64, 0)], [("a", 128, 32, 0)]],
            id="larger-than-bucket-chunks",
        ),
        pytest.param(
            [TensorSpec("s", "int8", (5,)), TensorSpec("a", F32, (20,))],
            64,
            [[("s", 0, 5, 0), ("a", 0, 56, 8)], [("a", 56, 24, 0)]],
            id="chunking-fills-current-bucket-first",
        ),
        pytest.param(
            [TensorSpec("a", F32, (16,)), TensorSpec("z", "float16", (0, 3))],
            64,
            [[("a", 0, 64, 0), ("z", 0, 0, 64)]],
            id="zero-size-still-planned",
        ),
        pytest.param(
            [
                TensorSpec("b", BF16, (3,)),
                TensorSpec("c", "bool", (1,)),
                TensorSpec("d", "float8_e4m3fn", (2,)),
                TensorSpec("e", "int64", ()),
            ],
            64,
            [[("b", 0, 6, 0), ("c", 0, 1, 6), ("d", 0, 2, 7), ("e", 0, 8, 16)]],
            id="mixed-dtypes-and-scalar",
        ),
        pytest.param(
            [TensorSpec("a", F32, (3,))],
            6,
            [[("a", 0, 4, 0)], [("a", 4, 4, 0)], [("a", 8, 4, 0)]],
            id="bucket-not-multiple-of-element",
        ),
    ],
)
def test_plan_table(specs, bucket, want) -> None:
    assert layout(plan_buckets(specs, bucket)) == want


def test_duplicate_names_rejected_before_planning() -> None:
    specs = [TensorSpec("w", F32, (1,)), TensorSpec("v", F32, (1,)), TensorSpec("w", F32, (2,))]
    with pytest.raises(ValueError, match=r"duplicate tensor names: \['w'\]"):
        plan_buckets(specs, 64)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ValueError, "bucket_size must be > 0 bytes, got 0"),
        (-5, ValueError, "got -5"),
        (True, TypeError, "got True"),
        (1.5, TypeError, "got 1.5"),
        (4, ValueError, "bucket_size 4 is smaller than one element \\(8 bytes\\)"),
    ],
)
def test_bad_bucket_sizes(value, error, match) -> None:
    with pytest.raises(error, match=match):
        check_bucket_size(value, [TensorSpec("x", "int64", (1,))])


def test_unknown_dtype_named() -> None:
    with pytest.raises(ValueError, match="unknown dtype name 'complex32'"):
        plan_buckets([TensorSpec("x", "complex32", (1,))], 64)


def test_digest_changes_with_inputs() -> None:
    a = [TensorSpec("x", F32, (2,))]
    assert plan_digest(a, 64) == plan_digest(list(a), 64)
    assert plan_digest(a, 64) != plan_digest(a, 128)
    assert plan_digest(a, 64) != plan_digest([TensorSpec("x", F32, (3,))], 64)


_DTYPES = ["float32", "bfloat16", "int8", "bool", "float8_e4m3fn", "int64", "float16"]


@given(
    shapes=st.lists(
        st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 9), max_size=3)),
        max_size=12,
    ),
    bucket=st.integers(8, 200),
)
def test_plan_invariants(shapes, bucket) -> None:
    specs = [TensorSpec(f"t{i}", d, tuple(s)) for i, (d, s) in enumerate(shapes)]
    buckets = plan_buckets(specs, bucket)
    covered: dict[str, int] = {}
    for b in buckets:
        assert max((p.offset + p.chunk_size for p in b), default=0) <= bucket
        ends = sorted((p.offset, p.offset + p.chunk_size) for p in b if p.chunk_size)
        assert all(x[1] <= y[0] for x, y in itertools.pairwise(ends)), "overlap"
        for p in b:
            item = TensorSpec(p.name, p.dtype, p.shape).itemsize
            assert p.offset % item == 0 and p.chunk_offset % item == 0
            assert p.chunk_offset == covered.get(p.name, 0), "chunks in order, no gaps"
            covered[p.name] = p.chunk_offset + p.chunk_size
    assert covered == {s.name: s.nbytes for s in specs}


# -- which buckets need a receive buffer (both sides decide it from the same inputs) ----------
def _buckets(specs, bucket):
    return plan_buckets(specs, bucket)


BIG = TensorSpec("big", "uint8", (100,))
SMALL = TensorSpec("small", "uint8", (10,))
EMPTY = TensorSpec("empty", "uint8", (0,))


@pytest.mark.parametrize(
    ("specs", "landing", "want"),
    [
        pytest.param([SMALL], {}, [0], id="nothing-lands-one-buffer"),
        pytest.param([SMALL], {"small": 10}, [-1], id="all-lands-no-buffer"),
        pytest.param([SMALL], {"small": 11}, [0], id="wrong-size-does-not-land"),
        pytest.param([EMPTY], {}, [-1], id="zero-bytes-need-no-buffer"),
        pytest.param([BIG, SMALL], {"big": 100}, [-1, -1, -1, 0], id="big-lands-small-buffered"),
        pytest.param(
            [SMALL, BIG, TensorSpec("s2", "uint8", (30,))],
            {},
            [0, 1, 0, 1, 0],
            id="buffers-taken-in-turn",
        ),
    ],
)
def test_buffer_slots(specs, landing, want) -> None:
    assert buffer_slots(_buckets(specs, 32), landing, 2) == want


def test_lands_only_whole_sized_nonempty_pieces() -> None:
    (piece,) = plan_buckets([SMALL], 32)[0]
    assert lands(piece, {"small": 10})
    assert not lands(piece, {"small": 9}) and not lands(piece, {})
    (empty,) = plan_buckets([EMPTY], 32)[0]
    assert not lands(empty, {"empty": 0})


def test_buffer_slots_rejects_no_buffers() -> None:
    with pytest.raises(ValueError, match="buffer_count must be >= 1"):
        buffer_slots([[]], {}, 0)


def test_cached_plan_is_planned_once_per_layout() -> None:
    specs = [TensorSpec(f"t{i}", F32, (7, i + 1)) for i in range(5)]
    first = cached_plan(specs, 64)
    assert cached_plan(list(specs), 64) is first  # same layout: the same plan object
    assert first.digest == plan_digest(specs, 64)
    assert [list(b) for b in first.buckets] == plan_buckets(specs, 64)
    assert cached_plan(specs, 128) is not first


def test_buffer_handoffs_credit_each_buffer_again_after_its_last_user() -> None:
    slots = [0, -1, 1, 0, -1, 1, 0]
    upfront, handoffs = buffer_handoffs(slots, 2)
    assert upfront == [0, 2]
    assert handoffs == {0: 3, 2: 5, 3: 6}
    assert buffer_handoffs([-1, -1], 2) == ([], {})
