"""The apiserver's OpenAPI v3 definition of ``PodTemplateSpec`` turned into a CRD
*structural* schema: what ``operator/refit_operator/api/schemas/`` holds and the CRD embeds.

Shared by the generator (``tests/cluster/pod_template_schema.py``, which reads the schema
the cluster tier's kube-apiserver serves at ``/openapi/v3/api/v1``) and the tests that
prove the checked-in file is that conversion (``tests/cluster/test_pod_template.py``) and
agrees with the per-version schemas of ``kubernetes-validate``
(``tests/unit/test_pod_template_schema.py``).

The rules, each a fact of the CRD structural-schema rules or of controller-gen's output
for the same Go types (JobSet, KubeRay embed PodTemplateSpec the same way):

- ``$ref`` and ``allOf: [{$ref}]`` are inlined (a CRD schema has no references);
- ``Quantity`` and ``IntOrString`` become ``x-kubernetes-int-or-string`` (integer or
  string); a quantity string must match the Quantity grammar, so ``8 GB`` is refused at
  apply time;
- ``ObjectMeta`` keeps ``labels`` and ``annotations`` only (the operator names its pods;
  a nested ``metadata`` without properties would be pruned to nothing);
- list and map semantics (``x-kubernetes-list-type``, ``-list-map-keys``, ``-map-type``),
  ``required``, ``enum`` and the integer formats stay; a ``default`` stays only where a
  list-map key needs one (a structural rule), so the apiserver adds nothing else to a
  user's template;
- descriptions go, except the template's own: two copies of PodSpec with every field's
  text would pass kubectl's 256 KiB ``last-applied-configuration`` limit.

Must not import: the operator (pure dicts in, dicts out).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ROOT = "io.k8s.api.core.v1.PodTemplateSpec"
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
#: The Quantity grammar of its own description (sign, number, binary/decimal SI or
#: exponent suffix), as controller-gen writes it for every resource.Quantity field.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_INT_OR_STRING = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
_KEEP = ("type", "required", "enum", "x-kubernetes-list-type", "x-kubernetes-map-type")
_FORMATS = frozenset({"int32", "int64"})
_DESCRIPTION = "A standard Kubernetes PodTemplateSpec (core/v1, Kubernetes 1.36)."


class ConversionError(ValueError):
    """The definitions hold a construct this conversion has no structural form for."""


def _name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _resolve(node: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The definition a node refers to (by ``$ref`` or a one-item ``allOf``), if any."""
    if "$ref" in node:
        return _name(node["$ref"]), {}
    all_of = node.get("allOf")
    if all_of and len(all_of) == 1 and "$ref" in all_of[0]:
        return _name(all_of[0]["$ref"]), {}
    return None, dict(node)


def convert(schemas: Mapping[str, Any], node: Mapping[str, Any], where: str) -> dict[str, Any]:
    """One node (and below) in structural form; ``schemas`` are the components' schemas."""
    ref, own = _resolve(node)
    if ref is not None:
        if ref in (QUANTITY, INT_OR_STRING):
            out: dict[str, Any] = {"x-kubernetes-int-or-string": True, **_INT_OR_STRING}
            if ref == QUANTITY:
                out["pattern"] = QUANTITY_PATTERN
            return out
        if ref == OBJECT_META:
            return _object_meta()
        return convert(schemas, schemas[ref], f"{where}<{_name(ref).rsplit('.', 1)[-1]}>")
    if "oneOf" in own or "anyOf" in own:
        raise ConversionError(f"{where}: a union other than Quantity/IntOrString")
    out = {key: own[key] for key in _KEEP if key in own}
    if own.get("format") in _FORMATS:
        out["format"] = own["format"]
    if "properties" in own:
        out["properties"] = {
            key: convert(schemas, child, f"{where}.{key}")
            for key, child in sorted(own["properties"].items())
        }
    if "items" in own:
        out["items"] = convert(schemas, own["items"], f"{where}[]")
    extra = own.get("additionalProperties")
    if isinstance(extra, dict):
        out["additionalProperties"] = convert(schemas, extra, f"{where}{{}}")
    if "x-kubernetes-list-map-keys" in own:
        keys = list(own["x-kubernetes-list-map-keys"])
        out["x-kubernetes-list-map-keys"] = keys
        _default_map_keys(schemas, own["items"], out["items"], keys, where)
    if "type" not in out:
        raise ConversionError(f"{where}: no type")
    if out["type"] == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _default_map_keys(
    schemas: Mapping[str, Any],
    raw_items: Mapping[str, Any],
    items: dict[str, Any],
    keys: list[str],
    where: str,
) -> None:
    """A list-map key must be required or defaulted: keep the upstream default of each
    optional key (``protocol: TCP`` of a container port)."""
    ref, own = _resolve(raw_items)
    raw = schemas[ref] if ref is not None else own
    required = set(raw.get("required") or ())
    for key in keys:
        if key in required:
            continue
        default = ((raw.get("properties") or {}).get(key) or {}).get("default")
        if default is None:
            raise ConversionError(f"{where}: list-map key {key!r} has no default and is optional")
        items["properties"][key]["default"] = default


def _object_meta() -> dict[str, Any]:
    strings = {"type": "object", "additionalProperties": {"type": "string"}}
    return {"type": "object", "properties": {"annotations": strings, "labels": dict(strings)}}


def pod_template_schema(schemas: Mapping[str, Any]) -> dict[str, Any]:
    """The structural schema of a PodTemplateSpec from ``components.schemas``."""
    out = convert(schemas, schemas[ROOT], "template")
    out["description"] = _DESCRIPTION
    return out


def walk(node: Mapping[str, Any], path: str = "") -> list[tuple[str, Mapping[str, Any]]]:
    """(path, node) of every node below ``node``, itself first."""
    out: list[tuple[str, Mapping[str, Any]]] = [(path, node)]
    for key, child in (node.get("properties") or {}).items():
        out += walk(child, f"{path}.{key}")
    if "items" in node:
        out += walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += walk(node["additionalProperties"], f"{path}{{}}")
    return out
