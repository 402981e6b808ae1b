"""Kubernetes quantities -> whole units (pure)."""

from __future__ import annotations

import pytest

from refit_operator.quantity import QuantityError, parse_quantity


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
