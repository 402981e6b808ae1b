"""Kubernetes resource quantities (``64Mi``, ``1G``, ``1500``) parsed to whole numbers,
and the ``bucketSize`` field type built on them (an integer or a quantity string).

Pure; must not import kopf or kubernetes.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated

from pydantic import PlainValidator, WithJsonSchema

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


#: A whole number of bytes above 0 with an optional suffix: what the CRD accepts for a
#: string bucketSize, and (with the validator's clearer messages) what the model accepts.
BUCKET_SIZE_PATTERN = r"^[0-9]*[1-9][0-9]*(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"


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
    if isinstance(value, str):
        if "." in value:
            raise ValueError(
                f"bucketSize {value!r} must be a whole number with an optional"
                f" suffix, without a fraction: write {str(size)!r}"
            )
        # Last, the CRD's own pattern: the API server and the models refuse alike.
        if not re.fullmatch(BUCKET_SIZE_PATTERN, value):
            raise unreadable
    return value


#: The bucketSize field: an integer or a quantity string, ``x-kubernetes-int-or-string`` in
#: the CRD (as Kubernetes' own quantities), with the pattern for strings and a minimum of 1.
BucketSize = Annotated[
    int | str,
    PlainValidator(_bucket_size),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": BUCKET_SIZE_PATTERN,
            "minimum": 1,
        }
    ),
]
