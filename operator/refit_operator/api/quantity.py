"""Kubernetes resource quantities (``64Mi``, ``1G``, ``1500``) parsed to whole numbers,
and the ``bucketSize`` field type built on them (an integer or a quantity string, from
``MIN_BUCKET_BYTES`` to ``MAX_BUCKET_BYTES``; a string's bounds are in its pattern, built
by :func:`whole_number_pattern`).

Pure.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated

from pydantic import PlainValidator, WithJsonSchema

from refit_worker.contract.bounds import MAX_BUCKET_BYTES, MIN_BUCKET_BYTES

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}

#: What the CRD schema accepts for a quantity string (same grammar as this parser).
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
_RE = re.compile(QUANTITY_PATTERN)


class QuantityError(ValueError):
    """A quantity string that cannot be read as a whole number of units."""


def parse_quantity(value: str | int) -> int:
    """Return the number of units (bytes for memory) that ``value`` stands for.

    Accepts non-negative integers and strings with a binary (``Mi``) or decimal (``M``)
    suffix.  Fractions must come out whole (``1.5Ki`` is fine, ``0.5`` is not).
    """
    if isinstance(value, bool):
        raise QuantityError(f"quantity {value!r} is a bool, not a number or string")
    if isinstance(value, int):
        if value < 0:
            raise QuantityError(f"quantity {value!r} is negative")
        return value
    text = value.strip()
    match = _RE.match(text)
    if match is None:
        raise QuantityError(
            f"quantity {value!r} is not a Kubernetes quantity such as '64Mi', '1G' or '1048576'"
        )
    suffix = match.group(2) or ""
    number = text[: len(text) - len(suffix)]
    try:
        amount = Decimal(number) * (_BINARY.get(suffix) or _DECIMAL[suffix])
    except InvalidOperation as exc:  # the pattern makes this unreachable; kept for safety
        raise QuantityError(f"quantity {value!r} has an unreadable number") from exc
    if amount != amount.to_integral_value():
        raise QuantityError(f"quantity {value!r} is not a whole number of units ({amount})")
    return int(amount)


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"[{first}-{last}]"


def _any(least: int, most: int) -> str:
    """Regex for ``least`` to ``most`` digits of any value."""
    count = str(least) if least == most else f"{least},{most}"
    return "" if most == 0 else "[0-9]" if count == "1" else f"[0-9]{{{count}}}"


def _digits(low: str, high: str) -> list[str]:
    """Regex alternatives for the digit strings from ``low`` to ``high``, both as long."""
    rest = len(low) - 1
    if low[0] == high[0]:
        return [low[0] + _group(_digits(low[1:], high[1:])) if rest else low]
    out: list[str] = []
    first, last = int(low[0]), int(high[0])
    if low[1:] != "0" * rest:  # low's first digit, then the rest of low's range
        out.append(low[0] + _group(_digits(low[1:], "9" * rest)))
        first += 1
    if high[1:] != "9" * rest:
        last -= 1
    if first <= last:  # whole runs under each first digit
        out.append(_span(first, last) + _any(rest, rest))
    if int(high[0]) != last:
        out.append(high[0] + _group(_digits("0" * rest, high[1:])))
    return out


def _group(alternatives: list[str]) -> str:
    return alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"


def whole_number_pattern(low: int, high: int) -> str:
    """A regex (no anchors, no leading zeros) for the whole numbers from ``low`` (>= 1) to
    ``high``: a JSON schema bounds a number in a string only by its pattern."""
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= low <= high, got {low} and {high}")
    lo, hi = str(low), str(high)
    if len(lo) == len(hi):
        return _group(_digits(lo, hi))
    # The rest of low's length, every length between, then high's length up to high.
    out = _digits(lo, "9" * len(lo))
    if len(lo) + 1 < len(hi):
        out.append("[1-9]" + _any(len(lo), len(hi) - 2))
    return _group([*out, *_digits("1" + "0" * (len(hi) - 1), hi)])


def _bounded_pattern(least: int, most: int) -> str:
    """The quantity strings from ``least`` to ``most`` units: per suffix, the numbers it
    allows (a suffix that allows none is left out), after any leading zeros."""
    parts = []
    for suffix, unit in (*_DECIMAL.items(), *_BINARY.items()):
        low, high = -(-least // unit), most // unit
        if low <= high:
            parts.append(whole_number_pattern(low, high) + suffix)
    return f"^0*(?:{'|'.join(parts)})$"


#: What the CRD accepts for a string bucketSize: a whole number of bytes with an optional
#: suffix, from MIN_BUCKET_BYTES to MAX_BUCKET_BYTES (the bounds in the number itself: the
#: API server has no quantity arithmetic that cel-python shares).
BUCKET_SIZE_PATTERN = _bounded_pattern(MIN_BUCKET_BYTES, MAX_BUCKET_BYTES)
#: The bounds in words, as the models' messages and the field's description say them.
BUCKET_SIZE_RANGE = f"from {MIN_BUCKET_BYTES} bytes to 64Gi ({MAX_BUCKET_BYTES} bytes)"


def _bucket_size(value: object) -> int | str:
    """bucketSize as the docs write it: ``64Mi``, ``"1048576"`` or an unquoted ``1048576``."""
    unreadable = ValueError(
        f"bucketSize {value!r} is not a whole number of bytes with an optional suffix,"
        " such as 64Mi, 1Gi or 1048576"
    )
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise unreadable
    if isinstance(value, int) and value <= 0:
        raise ValueError(f"bucketSize {value!r} must be more than 0 bytes")
    try:
        size = parse_quantity(value)
    except QuantityError as exc:
        raise unreadable from exc
    if size <= 0:
        raise ValueError(f"bucketSize {value!r} must be more than 0 bytes")
    if isinstance(value, str) and "." in value:
        raise ValueError(
            f"bucketSize {value!r} must be a whole number with an optional"
            f" suffix, without a fraction: write {str(size)!r}"
        )
    if size < MIN_BUCKET_BYTES:
        raise ValueError(
            f"bucketSize {value!r} is less than one element of the widest dtype the wire"
            f" carries: a bucket holds {BUCKET_SIZE_RANGE}"
        )
    if size > MAX_BUCKET_BYTES:
        raise ValueError(
            f"bucketSize {value!r} is {size} bytes, more than the largest bucket (every rank"
            f" allocates two in full): a bucket holds {BUCKET_SIZE_RANGE}"
        )
    # Last, the CRD's own pattern: the API server and the models refuse alike.
    if isinstance(value, str) and not re.fullmatch(BUCKET_SIZE_PATTERN, value):
        raise unreadable
    return value


#: The bucketSize field: an integer or a quantity string, ``x-kubernetes-int-or-string`` in
#: the CRD (as Kubernetes' own quantities), with the bounds as the pattern for strings and
#: as minimum and maximum for integers.
BucketSize = Annotated[
    int | str,
    PlainValidator(_bucket_size),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": BUCKET_SIZE_PATTERN,
            "minimum": MIN_BUCKET_BYTES,
            "maximum": MAX_BUCKET_BYTES,
        }
    ),
]
