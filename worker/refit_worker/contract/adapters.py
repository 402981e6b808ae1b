"""Adapter refits: what travels with a LoRA adapter's tensors, and the rules both sides
apply to it (pure: no torch, no I/O beyond :func:`checkpoint_digest`'s file reads).

An adapter refit sends only a PEFT LoRA adapter's tensors (``...lora_A.weight`` and
``...lora_B.weight``, named as ``get_peft_model_state_dict`` names them).  Its
:class:`AdapterHeader` (rank, alpha, target modules, and the base model's identity and
digest) rides in the same refit as the JSON extra :data:`ADAPTER_EXTRA`, so the same
integrity hashes cover it.  A rollout serving another base refuses the refit before it
lands (:func:`base_refusal`), naming both digests.  Each committed adapter refit is served
under its own name, :func:`version_name` (``<adapter>-v<refit>``), so a request naming a
version never gets another's weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: The extra (``refit.extra.<this>``) carrying an adapter refit's header as UTF-8 JSON.
ADAPTER_EXTRA = "adapter"
#: Names under this prefix ride along with a refit but are no weights (the same as
#: ``refit_worker.integrations.staged.EXTRA_PREFIX``).
EXTRAS = "refit.extra."
#: The header's name in the refit.
ADAPTER_EXTRA_NAME = EXTRAS + ADAPTER_EXTRA
#: PEFT's LoRA tensor names: ``<module path>.lora_A.weight`` / ``.lora_B.weight``.
_LORA_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


class AdapterKnobs(BaseModel):
    """``spec.transfer.adapter``: the job's refits carry a LoRA adapter, not the model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(
        None,
        min_length=1,
        max_length=48,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Name of the served adapter; each refit k is served as <name>-v<k> "
        "(default: the job's name).",
    )
    keep: int = Field(
        1,
        ge=1,
        le=64,
        description="Adapter versions a rollout keeps loaded (the newest, the default, "
        "included; at most vLLM's max_loras). A request naming an older one is refused.",
    )


class AdapterHeader(BaseModel):
    """What an adapter refit says about its tensors and the base they apply to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["peft-lora"] = "peft-lora"
    #: The served adapter's name (versions are ``<name>-v<refit>``).
    name: str = Field(min_length=1, max_length=48)
    rank: int = Field(ge=1, le=4096)
    alpha: float = Field(gt=0)
    target_modules: tuple[str, ...] = Field(min_length=1)
    #: The base model's identity (a hub id or checkpoint name) and digest
    #: (:func:`checkpoint_digest` of its checkpoint).
    base: str = Field(min_length=1, max_length=256)
    base_digest: str = Field(min_length=16, max_length=64, pattern=r"^[0-9a-f]+$")

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, data: bytes) -> AdapterHeader:
        """Parse a received header; ValueError (pydantic's) names what is wrong."""
        return cls.model_validate_json(data)

    def peft_config(self) -> dict[str, object]:
        """The ``adapter_config.json`` PEFT (and vLLM's loader) reads for these tensors."""
        return {
            "peft_type": "LORA",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.target_modules),
            "bias": "none",
            "base_model_name_or_path": self.base,
        }


def version_name(adapter: str, refit: int) -> str:
    """The name refit ``refit`` of ``adapter`` is served under."""
    return f"{adapter}-v{refit}"


def base_refusal(header: AdapterHeader, served_base: str, served_digest: str) -> str | None:
    """Why a rollout serving ``served_base`` (digest ``served_digest``) must refuse the
    adapter refit ``header`` describes; None: it applies to the served base."""
    if header.base_digest == served_digest:
        return None
    return (
        f"adapter {header.name!r} was trained on base {header.base!r} (digest "
        f"{header.base_digest}), but this rollout serves {served_base!r} (digest "
        f"{served_digest})"
    )


def adapter_problems(header: AdapterHeader, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Why tensors of ``shapes`` are not the LoRA adapter ``header`` describes (empty:
    they are): PEFT LoRA names only, each module with both A and B, of the header's rank,
    on one of its target modules."""
    problems: list[str] = []
    seen: dict[str, set[str]] = {}
    for name, shape in sorted(shapes.items()):
        found = _LORA_NAME.match(name)
        if found is None:
            problems.append(f"{name!r} is no PEFT LoRA tensor (<module>.lora_A/B.weight)")
            continue
        module, ab = found["module"], found["ab"]
        seen.setdefault(module, set()).add(ab)
        if module.rsplit(".", 1)[-1] not in header.target_modules:
            problems.append(f"{name!r} is not on a target module {list(header.target_modules)}")
        rank_dim = shape[0] if ab == "A" else shape[-1]
        if len(shape) != 2 or rank_dim != header.rank:
            problems.append(f"{name!r} has shape {shape}, not of rank {header.rank}")
    problems += [
        f"{module!r} lacks lora_{'B' if ab == {'A'} else 'A'}"
        for module, ab in sorted(seen.items())
        if len(ab) == 1
    ]
    if not seen and not problems:
        problems.append("no LoRA tensor was sent")
    return problems


def checkpoint_digest(model_dir: str | os.PathLike[str]) -> str:
    """The digest of a checkpoint's weights: SHA-256 over each ``*.safetensors`` file's
    name and bytes, in name order (what both sides compute from the same checkpoint)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}: cannot digest the base")
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()[:32]


def header_json(data: Iterable[int]) -> AdapterHeader:
    """The header from the extra's bytes (a uint8 tensor's ``tolist()`` or ``bytes``)."""
    raw = bytes(data)
    try:
        json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"the adapter header is not JSON: {exc}") from exc
    return AdapterHeader.decode(raw)
