"""What ``refit run`` refuses before anything starts, because one machine cannot honour it.

Two kinds of input would otherwise pass validation and fail later, worse:

- a checkpoint tensor whose dtype the worker cannot move (``uint16``, ``float8_e8m0``...):
  the worker would fail only after its gang had connected.  The safetensors headers say
  every dtype for the price of a few kilobytes, so they are read here;
- an env value taken from a Secret or ConfigMap (``valueFrom.secretKeyRef``, ``envFrom``):
  there is no API server to read it from, and every pod would fail to start.

Pure apart from reading the checkpoint's headers; returns sentences, raises nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from refit_worker.contract.safetensors_header import SAFETENSORS_DTYPES as MOVABLE
from refit_worker.contract.safetensors_header import HeaderError, read_entries, supported

#: Tensors named per refusal before the rest are counted.
SHOWN = 5
#: valueFrom sources a node reads from the API; what a local run offers instead.
_API_SOURCES = {
    "secretKeyRef": "a Secret",
    "configMapKeyRef": "a ConfigMap",
}
_INSTEAD = (
    "a local run has no API server to read it from; give the value inline (env: "
    "[{name: ..., value: ...}]) in a copy of the manifest for local use"
)


def checkpoint_problem(files: Sequence[Path]) -> str | None:
    """Why the worker cannot move this checkpoint, or None: unreadable headers, dtypes the
    wire does not carry, a tensor name in two files (the worker refuses each)."""
    seen: dict[str, Path] = {}
    bad: list[str] = []
    for file in files:
        try:
            entries = read_entries(file)
        except HeaderError as exc:
            return str(exc)
        for entry in entries:
            if entry.name in seen:
                return (
                    f"tensor {entry.name!r} appears in both {seen[entry.name]} and {file}: "
                    "the worker refuses a name it would overwrite"
                )
            seen[entry.name] = file
            if entry.dtype not in MOVABLE:
                bad.append(f"tensor {entry.name!r} has dtype {entry.dtype} ({file})")
    if not bad:
        return None
    more = f"; and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
    return (
        "the worker cannot move this checkpoint: "
        + "; ".join(bad[:SHOWN])
        + more
        + f". Supported dtypes: {supported()}; convert those tensors (e.g. to int32) first"
    )


def unhonourable(raw_spec: Mapping[str, Any]) -> list[str]:
    """What the spec's pod templates ask of the API that no local run can give."""
    problems = []
    for role in ("policy", "rollout"):
        template = (raw_spec.get(role) or {}).get("template") or {}
        containers = (template.get("spec") or {}).get("containers") or []
        for container in containers:
            where = f"spec.{role}.template.spec.containers[{container.get('name', '?')}]"
            problems += list(_env_problems(where, container))
    return problems


def _env_problems(where: str, container: Mapping[str, Any]) -> Iterator[str]:
    for item in container.get("env") or []:
        source = item.get("valueFrom") or {}
        for key, what in _API_SOURCES.items():
            if key in source:
                ref = source[key] or {}
                yield (
                    f"{where}.env[{item.get('name')}]: valueFrom.{key} reads {what} "
                    f"({ref.get('name')!r}, key {ref.get('key')!r}); {_INSTEAD}"
                )
        if "resourceFieldRef" in source:
            yield (
                f"{where}.env[{item.get('name')}]: valueFrom.resourceFieldRef: a local run "
                "sets no container resources to read; give the value inline"
            )
    for item in container.get("envFrom") or []:
        for key, what in (("secretRef", "a Secret"), ("configMapRef", "a ConfigMap")):
            if key in item:
                yield (
                    f"{where}.envFrom: {key} reads {what} "
                    f"({(item[key] or {}).get('name')!r}); {_INSTEAD}"
                )
