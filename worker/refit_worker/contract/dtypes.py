"""Dtype names: which the wire carries, and which synthetic weights are generated in.

Names are torch's own attribute names (``torch.bfloat16`` → ``"bfloat16"``); the mapping to
torch dtypes lives in the checkpoint engine (``engine.base``), which is the only
registry.  Here they are plain ``Literal`` types, so the RefitJob models and the generated
CRD refuse a dtype the worker cannot use before any pod starts, and each one's width in
bytes (:data:`ITEMSIZE`), which sizes a model and bounds the smallest bucket.
"""

from __future__ import annotations

from typing import Literal, get_args

#: What a transfer bucket's manifest may name: anything else is refused by the receiver.
WireDtype = Literal[
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
]
WIRE_DTYPE_NAMES: tuple[WireDtype, ...] = get_args(WireDtype)

#: What ``SyntheticWeights.dtype`` may be: the dtypes the synthetic model is generated and
#: advanced in (training and inference dtypes; no float64).
SyntheticDtype = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "int8"]
SYNTHETIC_DTYPE_NAMES: tuple[SyntheticDtype, ...] = get_args(SyntheticDtype)

#: Bytes per element of each wire dtype (what ``torch.empty((), dtype=d).element_size()``
#: says; ``tests/unit/test_weights.py`` checks the two agree).
ITEMSIZE: dict[WireDtype, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
