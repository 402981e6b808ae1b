"""The header of a ``.safetensors`` file, read without torch: which tensors, which dtypes.

A safetensors file opens with an 8-byte little-endian length and that many bytes of JSON
naming every tensor's dtype, shape and byte range.  Reading it costs a few kilobytes, so
``refit run`` (which must not import torch) can refuse a checkpoint whose dtypes the worker
cannot move before any process starts, instead of the worker failing after its gang has
connected.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from refit_worker.contract.dtypes import WireDtype

#: safetensors' dtype codes that the wire carries, and their wire (torch) names.
SAFETENSORS_DTYPES: dict[str, WireDtype] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
#: The safetensors format's own cap on the header (100 MB): more is a corrupt file.
MAX_HEADER_BYTES = 100_000_000


class HeaderError(ValueError):
    """A file that is not a readable safetensors file; the message names it."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    #: safetensors' code, e.g. ``BF16`` or ``U16``.
    dtype: str
    shape: tuple[int, ...]


def supported() -> str:
    """The dtypes the worker moves, as a person reads them (``BF16 (bfloat16)``, ...)."""
    return ", ".join(f"{code} ({wire})" for code, wire in SAFETENSORS_DTYPES.items())


def read_entries(path: Path) -> list[TensorEntry]:
    """Every tensor the file's header declares, in header order."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HeaderError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES:
                raise HeaderError(
                    f"{path}: not a safetensors file (declares a {length}-byte header)"
                )
            raw = f.read(length)
    except OSError as exc:
        raise HeaderError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if len(raw) < length:
        raise HeaderError(f"{path}: truncated: the header needs {length} bytes")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HeaderError(f"{path}: not a safetensors file (header is not JSON: {exc})") from exc
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: not a safetensors file (header is not a JSON object)")
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
            raise HeaderError(f"{path}: tensor {name!r} has no dtype in the header")
        shape = info.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise HeaderError(f"{path}: tensor {name!r} has no valid shape in the header")
        entries.append(TensorEntry(name, info["dtype"], tuple(shape)))
    return entries


def unmovable(path: Path) -> list[TensorEntry]:
    """The tensors of ``path`` whose dtype the wire does not carry."""
    return [e for e in read_entries(path) if e.dtype not in SAFETENSORS_DTYPES]
