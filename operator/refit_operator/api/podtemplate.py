"""A role's pod template: the upstream ``PodTemplateSpec`` schema and its validation.

``schemas/pod-template-spec.json`` is the schema kube-apiserver 1.36 serves for
``io.k8s.api.core.v1.PodTemplateSpec``, already in CRD structural form (written by
``python -m tests.cluster.pod_template_schema``; a cluster test proves it is what the
apiserver serves, a unit test that it agrees with ``kubernetes-validate``'s 1.36 schema).
The models embed it as the JSON schema of ``RoleSpec.template`` (so the CRD carries it) and
check a template against it with :func:`schema_problems`, the way the apiserver's
structural validation does: types (int-or-string included), enums, patterns, required
fields, unknown fields (as ``kubectl``'s strict field validation), list-map keys unique.

Pure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

SCHEMA_FILE = "pod-template-spec.json"
#: int32 fields (ports, seconds, ...): the apiserver refuses values outside this range.
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}
_WORDS = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean",
    "object": "an object",
    "array": "a list",
}
#: Problems listed per template; past this many, the rest are counted.
MAX_PROBLEMS = 8


@cache
def _file() -> dict[str, Any]:
    text = resources.files("refit_operator.api").joinpath("schemas", SCHEMA_FILE).read_text()
    content: dict[str, Any] = json.loads(text)
    return content


def pod_template_schema() -> dict[str, Any]:
    """The structural schema of a PodTemplateSpec (callers must not change it)."""
    schema: dict[str, Any] = _file()["schema"]
    return schema


@cache
def _pattern(pattern: str) -> re.Pattern[str]:
    # RE2 (the apiserver's engine) reads `$` as end of text; Python's `$` also matches
    # before a final newline.
    return re.compile(pattern[:-1] + r"\Z" if pattern.endswith("$") else pattern)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_problem(node: Mapping[str, Any], value: Any) -> str | None:
    if node.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, int | str):
            return f"must be an integer or a string (got {_shown(value)})"
        return None
    kind = node.get("type")
    if kind is None:
        return None
    if isinstance(value, bool) != (kind == "boolean") or not isinstance(value, _JSON_TYPES[kind]):
        return f"must be {_WORDS[kind]} (got {_shown(value)})"
    return None


def _map_key(node: Mapping[str, Any], item: Mapping[str, Any]) -> tuple[Any, ...]:
    props = (node.get("items") or {}).get("properties") or {}
    keys = node.get("x-kubernetes-list-map-keys") or ()
    return tuple(item.get(k, (props.get(k) or {}).get("default")) for k in keys)


def _duplicates(node: Mapping[str, Any], value: list[Any], where: str) -> list[str]:
    kind = node.get("x-kubernetes-list-type")
    seen: set[str] = set()
    out = []
    for i, item in enumerate(value):
        if kind == "map" and isinstance(item, dict):
            keys = _map_key(node, item)
            shown: Any = keys[0] if len(keys) == 1 else keys
        elif kind == "set":
            keys, shown = (item,), item
        else:
            continue
        text = json.dumps(keys, sort_keys=True)
        if text in seen:
            out.append(f"{where}[{i}]: duplicate entry {_shown(shown)}")
        seen.add(text)
    return out


def schema_problems(node: Mapping[str, Any], value: Any, where: str = "") -> list[str]:
    """Why ``value`` fails the structural schema ``node`` (empty: it passes)."""
    if value is None:
        return [] if node.get("nullable") else [f"{where}: must not be null"]
    problem = _type_problem(node, value)
    if problem:
        return [f"{where}: {problem}"]
    out: list[str] = []
    if "enum" in node and value not in node["enum"]:
        choices = ", ".join(repr(v) for v in node["enum"])
        out.append(f"{where}: must be one of {choices} (got {_shown(value)})")
    if isinstance(value, str) and "pattern" in node and not _pattern(node["pattern"]).search(value):
        out.append(f"{where}: {_shown(value)} does not match {node['pattern']}")
    if isinstance(value, int) and not isinstance(value, bool):
        low, high = _INT_RANGES.get(str(node.get("format")), (None, None))
        if low is not None and high is not None and not low <= value <= high:
            out.append(f"{where}: {value} is out of the {node['format']} range")
        if "minimum" in node and value < node["minimum"]:
            out.append(f"{where}: must be at least {node['minimum']} (got {value})")
    if isinstance(value, list):
        for i, item in enumerate(value):
            out += schema_problems(node["items"], item, f"{where}[{i}]")
        out += _duplicates(node, value, where)
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties")
        for key, item in value.items():
            if key in props:
                out += schema_problems(props[key], item, f"{where}.{key}")
            elif isinstance(extra, dict):
                out += schema_problems(extra, item, f"{where}.{key}")
            elif not node.get("x-kubernetes-preserve-unknown-fields"):
                out.append(f"{where}.{key}: unknown field")
        out += [f"{where}.{key}: required" for key in node.get("required", ()) if key not in value]
    return out


def template_problems(template: Any) -> list[str]:
    """Why ``template`` is not a valid PodTemplateSpec, paths relative to it."""
    return schema_problems(pod_template_schema(), template)


def summarise(problems: list[str]) -> str:
    shown = problems[:MAX_PROBLEMS]
    more = len(problems) - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")
