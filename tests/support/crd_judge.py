"""The generated CRD as an API server would judge a RefitJob spec, offline (pure): the
CRD judge, shared by the unit tests and ``bench/reliability_badinput.py``.

:func:`crd_verdict` applies the schema's defaults (as the apiserver does before it
validates), then checks the OpenAPI v3 subset the CRD uses -- type, enum, bounds with
OpenAPI's boolean ``exclusiveMinimum``, lengths, patterns with RE2's end-of-text ``$``,
required, nullable, additionalProperties, ``x-kubernetes-preserve-unknown-fields``,
``x-kubernetes-int-or-string``, int32/int64 ranges, unique keys of ``map`` and ``set``
lists -- with
unknown fields refused as ``kubectl apply`` does (field validation Strict), and then runs
the ``x-kubernetes-validations`` rules with cel-python, a real CEL interpreter (transition
rules, which see ``oldSelf``, run on updates only and are skipped: the judge sees creates).
:func:`model_verdict` is the operator's :func:`parse_spec` side.
``tests/unit/test_crd_agreement.py`` compares the two on generated specs;
``tests/unit/test_crd_agreement_judge.py`` shows the judge refuses what it must.

Real: the generated CRD, cel-python, the models.  Nothing emulated.
"""

from __future__ import annotations

import copy
import math
import re
from functools import cache
from typing import Any

import celpy

from refit_operator.api.crd import crd_manifest
from refit_operator.api.models import InvalidSpecError, parse_spec


@cache
def spec_schema() -> dict[str, Any]:
    """The ``spec`` node of the generated CRD's openAPIV3Schema (callers must not change it)."""
    root = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema: dict[str, Any] = root["properties"]["spec"]
    return schema


def apply_defaults(node: dict[str, Any], value: Any) -> Any:
    """``value`` with the schema's defaults filled in below it, as the apiserver does."""
    if isinstance(value, dict):
        out = dict(value)
        props = node.get("properties") or {}
        for key, child in props.items():
            if key not in out and "default" in child:
                out[key] = copy.deepcopy(child["default"])
        for key, item in out.items():
            child = props.get(key) or (
                node["additionalProperties"]
                if isinstance(node.get("additionalProperties"), dict)
                else None
            )
            if child is not None:
                out[key] = apply_defaults(child, item)
        return out
    if isinstance(value, list) and "items" in node:
        return [apply_defaults(node["items"], item) for item in value]
    return value


def re2(pattern: str) -> re.Pattern[str]:
    # RE2 (the apiserver's engine) reads `$` as end of text; Python's also matches before a
    # final newline, so the anchor is spelled `\Z` here.
    return re.compile(pattern[:-1] + r"\Z" if pattern.endswith("$") else pattern)


_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def crd_problems(node: dict[str, Any], value: Any, where: str = "spec") -> list[str]:
    """Why ``value`` (already defaulted) fails ``node``, schema first, then CEL rules."""
    if value is None:
        return [] if node.get("nullable") else [f"{where}: must not be null"]
    kind = node.get("type")
    if node.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, int | str):
            return [f"{where}: must be of type integer or string"]
    elif kind is not None:
        ok = isinstance(value, _TYPES[kind]) and (kind == "boolean") == isinstance(value, bool)
        if not ok:
            return [f"{where}: must be of type {kind}"]
    problems: list[str] = []
    if "enum" in node and value not in node["enum"]:
        problems.append(f"{where}: must be one of {node['enum']}")
    if isinstance(value, str):
        if len(value) < node.get("minLength", 0):
            problems.append(f"{where}: shorter than {node['minLength']}")
        if "maxLength" in node and len(value) > node["maxLength"]:
            problems.append(f"{where}: longer than {node['maxLength']}")
        if "pattern" in node and not re2(node["pattern"]).search(value):
            problems.append(f"{where}: does not match {node['pattern']}")
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{where}: {value} cannot be sent as JSON, so never reaches the API"]
    if isinstance(value, int) and not isinstance(value, bool) and node.get("format") in _RANGES:
        bottom, top = _RANGES[node["format"]]
        if not bottom <= value <= top:
            problems.append(f"{where}: not of format {node['format']}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        low, high = node.get("minimum"), node.get("maximum")
        if low is not None and (value <= low if node.get("exclusiveMinimum") else value < low):
            problems.append(f"{where}: below the minimum {low}")
        if high is not None and (value >= high if node.get("exclusiveMaximum") else value > high):
            problems.append(f"{where}: above the maximum {high}")
    if isinstance(value, list):
        for i, item in enumerate(value):
            problems += crd_problems(node["items"], item, f"{where}[{i}]")
        problems += _duplicates(node, value, where)
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties")
        for key, item in value.items():
            if key in props:
                problems += crd_problems(props[key], item, f"{where}.{key}")
            elif isinstance(extra, dict):
                problems += crd_problems(extra, item, f"{where}.{key}")
            elif not node.get("x-kubernetes-preserve-unknown-fields"):
                problems.append(f"{where}.{key}: unknown field")
        problems += [
            f"{where}.{key}: required" for key in node.get("required", ()) if key not in value
        ]
    if not problems:  # CEL runs on values that have the schema's shape
        for rule in node.get("x-kubernetes-validations", ()):
            if "oldSelf" in rule["rule"]:
                continue  # a transition rule: the apiserver runs it on updates only
            if not _cel(rule["rule"], value):
                problems.append(f"{where}: {rule['message']}")
    return problems


#: Integer formats the apiserver checks the range of.
_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def _duplicates(node: dict[str, Any], value: list[Any], where: str) -> list[str]:
    """Entries of a ``map`` list with the same keys, or of a ``set`` list twice: the
    apiserver's "Duplicate value" (the keys' defaults are already filled in)."""
    kind = node.get("x-kubernetes-list-type")
    if kind not in ("map", "set"):
        return []
    keys = node.get("x-kubernetes-list-map-keys") or ()
    seen: list[Any] = []
    out = []
    for i, item in enumerate(value):
        key = [item.get(k) for k in keys] if kind == "map" and isinstance(item, dict) else item
        if key in seen:
            out.append(f"{where}[{i}]: Duplicate value")
        seen.append(key)
    return out


@cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _rules(node: dict[str, Any]) -> list[str]:
    found = [r["rule"] for r in node.get("x-kubernetes-validations", ())]
    for child in (node.get("properties") or {}).values():
        found += _rules(child)
    return found + (_rules(node["items"]) if "items" in node else [])


def _cel(rule: str, value: Any) -> bool:
    return bool(_program(rule).evaluate({"self": celpy.json_to_cel(value)}))


# Compile now: cel-python raises the recursion limit on first use, which hypothesis would
# warn about if it happened inside a test.
for _rule in _rules(spec_schema()):
    _program(_rule)


def crd_verdict(spec: Any) -> list[str]:
    """The apiserver's problems with ``spec`` (empty: it would be stored)."""
    schema = spec_schema()
    return crd_problems(schema, apply_defaults(schema, spec))


def model_verdict(spec: Any) -> str | None:
    """:func:`parse_spec`'s message for ``spec``, or None when it accepts it."""
    try:
        parse_spec(spec)
    except InvalidSpecError as exc:
        return str(exc)
    return None
