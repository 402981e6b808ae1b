"""Kubernetes quantities -> whole units, and the bucketSize field's bounds: in words for
the models, as a pattern for the CRD (pure)."""

from __future__ import annotations

import random
import re

import pytest
from pydantic import TypeAdapter, ValidationError

from refit_operator.api.quantity import (
    BUCKET_SIZE_PATTERN,
    BucketSize,
    QuantityError,
    parse_quantity,
    whole_number_pattern,
)
from refit_worker.contract.bounds import MAX_BUCKET_BYTES, MIN_BUCKET_BYTES

_Bucket: TypeAdapter[int | str] = TypeAdapter(BucketSize)


@pytest.mark.parametrize(
    ("text", "units"),
    [
        ("0", 0),
        ("1", 1),
        ("64Mi", 64 << 20),
        ("1Gi", 1 << 30),
        ("1.5Ki", 1536),
        ("1k", 1000),
        ("2M", 2_000_000),
        ("3G", 3_000_000_000),
        (" 8Ki ", 8192),
        (4096, 4096),
    ],
)
def test_parses(text: str | int, units: int) -> None:
    assert parse_quantity(text) == units


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("64MB", "'64MB' is not a Kubernetes quantity"),
        ("-1", "'-1' is not a Kubernetes quantity"),
        ("0.5", "not a whole number"),
        ("1.5", "not a whole number"),
        ("", "is not a Kubernetes quantity"),
        ("Mi", "is not a Kubernetes quantity"),
        (-3, "negative"),
        (True, "bool"),
    ],
)
def test_rejects_with_the_value_named(value: str | int, fragment: str) -> None:
    with pytest.raises(QuantityError, match=fragment.replace(".", r"\.")):
        parse_quantity(value)


def _numbers_near(*points: int) -> set[int]:
    """Every number within 12 of a point, of a power of ten or one less, up to 10x the
    largest point: where a digit-wise pattern goes wrong first."""
    top = 10 * max(points)
    edges = {*points, *(10**k for k in range(len(str(top)) + 1))}
    return {n + d for n in edges for d in range(-12, 13) if 0 <= n + d <= top}


@pytest.mark.parametrize(
    ("low", "high"),
    [
        (1, 1),
        (1, 9),
        (8, 9),
        (1, 10),
        (9, 10),
        (10, 99),
        (15, 23),
        (1, 64),
        (7, 1000),
        (99, 101),
        (123, 98765),
        (1000, 1000),
        (8, MAX_BUCKET_BYTES),
        (1, MAX_BUCKET_BYTES // 1000),
    ],
)
def test_whole_number_pattern_matches_the_range_and_nothing_else(low: int, high: int) -> None:
    pattern = re.compile(whole_number_pattern(low, high))
    for n in _numbers_near(low, high) | set(range(1200)):
        assert bool(pattern.fullmatch(str(n))) == (low <= n <= high), n
    assert not pattern.fullmatch(f"0{low}")  # leading zeros are the caller's to allow


def test_whole_number_pattern_on_random_ranges() -> None:
    rnd = random.Random(50)
    for _ in range(200):
        low = rnd.randint(1, 10 ** rnd.randint(1, 12))
        high = low + rnd.randint(0, 10 ** rnd.randint(0, 12))
        pattern = re.compile(whole_number_pattern(low, high))
        probes = {low - 1, low, low + 1, high - 1, high, high + 1}
        probes |= {rnd.randint(max(low - 1000, 0), high + 1000) for _ in range(100)}
        for n in probes:
            assert bool(pattern.fullmatch(str(n))) == (low <= n <= high), (low, high, n)


def test_whole_number_pattern_refuses_an_empty_range() -> None:
    with pytest.raises(ValueError, match="1 <= low <= high"):
        whole_number_pattern(5, 4)


@pytest.mark.parametrize("suffix", ["", "k", "M", "G", "T", "Ki", "Mi", "Gi", "Ti", "Ei"])
def test_the_bucket_size_pattern_holds_the_bounds_for_every_suffix(suffix: str) -> None:
    unit = parse_quantity(f"1{suffix}")
    edges = (MIN_BUCKET_BYTES // unit, MAX_BUCKET_BYTES // unit, 1)
    for n in _numbers_near(*edges):
        if n == 0:
            continue
        text = f"{n}{suffix}"
        inside = MIN_BUCKET_BYTES <= n * unit <= MAX_BUCKET_BYTES
        assert bool(re.fullmatch(BUCKET_SIZE_PATTERN, text)) == inside, text
        assert bool(re.fullmatch(BUCKET_SIZE_PATTERN, f"000{text}")) == inside, text


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (MIN_BUCKET_BYTES - 1, "less than one element of the widest dtype"),
        ("1Ti", "'1Ti' is 1099511627776 bytes, more than the largest bucket"),
        (MAX_BUCKET_BYTES + 1, "more than the largest bucket"),
        ("00", "must be more than 0 bytes"),
    ],
)
def test_a_bucket_size_out_of_range_is_refused_in_words(value: int | str, words: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(words)):
        _Bucket.validate_python(value)


@pytest.mark.parametrize(
    "value", [MIN_BUCKET_BYTES, str(MIN_BUCKET_BYTES), "64Gi", MAX_BUCKET_BYTES, "0064Gi", "1k"]
)
def test_the_bounds_themselves_are_buckets(value: int | str) -> None:
    assert _Bucket.validate_python(value) == value
