"""The RefitJob CustomResourceDefinition, generated from the pydantic models.

pydantic's JSON Schema is turned into a Kubernetes *structural* schema: references inlined,
``Optional`` as ``nullable``, free-form objects marked ``x-kubernetes-preserve-unknown-fields``,
titles dropped; integer-or-string nodes (quantities) and the embedded upstream
PodTemplateSpec (``podtemplate.py``: list-map keys, map types) pass through as they are.
An unexpected JSON Schema construct is an error here rather than a CRD the
apiserver would refuse.  The output is deterministic (sorted keys), so a test can compare the
checked-in ``crds/refitjob.yaml`` with it.
"""

from __future__ import annotations

from typing import Any

import yaml

from refit_operator.api.models import GROUP, KIND, PLURAL, VERSION, RefitJobSpec, RefitJobStatus

_KEEP = frozenset(
    {
        "type",
        "properties",
        "items",
        "required",
        "description",
        "default",
        "enum",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minItems",
        "maxItems",
        "x-kubernetes-validations",
        # List and map semantics of the embedded upstream PodTemplateSpec.
        "x-kubernetes-list-type",
        "x-kubernetes-list-map-keys",
        "x-kubernetes-map-type",
        "nullable",
        "x-kubernetes-preserve-unknown-fields",
    }
)
#: The one union a structural schema allows: integer or string (quantities, ports).
INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]
_DROP = frozenset({"title"})


_INT_OR_STRING_KEYS = frozenset({"x-kubernetes-int-or-string", "anyOf"})


class SchemaError(ValueError):
    """A model produced JSON Schema that has no structural equivalent here."""


def structural(schema: dict[str, Any], defs: dict[str, Any], where: str = "") -> dict[str, Any]:
    """Convert one pydantic JSON Schema node (and below) to a structural schema node."""
    node = dict(schema)
    if "$ref" in node:
        target = node.pop("$ref").rsplit("/", 1)[-1]
        node = {**defs[target], **node}
    if node.get("x-kubernetes-int-or-string"):
        if node.get("anyOf") != INT_OR_STRING:
            raise SchemaError(f"{where}: int-or-string must be anyOf integer, string")
        return {k: v for k, v in node.items() if k in _KEEP or k in _INT_OR_STRING_KEYS}
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o != {"type": "null"}]
        if len(options) != 1:
            raise SchemaError(f"{where or '<root>'}: only Optional[X] unions are supported")
        node = {**structural(options[0], defs, where), **node, "nullable": True}
        if node.get("default", 0) is None:
            del node["default"]
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node and not isinstance(node[bound], bool):
            # JSON Schema 2020-12 puts the number here; OpenAPI v3 (Kubernetes) a flag.
            node[limit], node[bound] = node[bound], True
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {k: structural(v, defs, f"{where}.{k}") for k, v in value.items()}
        elif key == "items":
            out[key] = structural(value, defs, f"{where}[]")
        elif key == "additionalProperties":
            if value is True:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif isinstance(value, dict):
                out[key] = structural(value, defs, f"{where}{{}}")
            # False: structural schemas prune unknown fields already
        elif key in _KEEP:
            out[key] = value
        elif key == "$defs":
            continue
        else:
            raise SchemaError(f"{where or '<root>'}: unsupported JSON Schema keyword {key!r}")
    if "type" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        raise SchemaError(f"{where or '<root>'}: every node needs a type")
    if (
        out.get("type") == "object"
        and "properties" not in out
        and "additionalProperties" not in out
    ):
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _model_schema(model: type[RefitJobSpec] | type[RefitJobStatus], mode: str) -> dict[str, Any]:
    raw = model.model_json_schema(
        by_alias=True, mode="validation" if mode == "v" else "serialization"
    )
    return structural(raw, raw.get("$defs", {}), model.__name__)


_PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {
        "name": "Policy",
        "type": "integer",
        "jsonPath": ".status.policy.ready",
        "description": "Policy pods ready",
    },
    {
        "name": "Rollout",
        "type": "integer",
        "jsonPath": ".status.rollout.ready",
        "description": "Rollout pods ready",
    },
    {
        "name": "Desired",
        "type": "integer",
        "jsonPath": ".status.rollout.desired",
        "description": "Rollout replicas asked for (spec.rollout.replicas, the scale)",
        "priority": 1,
    },
    {
        "name": "Replaced",
        "type": "integer",
        "jsonPath": ".status.rollout.replacements",
        "description": "Rollout replicas replaced alone",
        "priority": 1,
    },
    {"name": "Refits", "type": "integer", "jsonPath": ".status.refitsCompleted"},
    {"name": "Epoch", "type": "integer", "jsonPath": ".status.epoch", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


#: ``kubectl scale``, ``kubectl autoscale`` and an HPA drive the rollout replica count.
_SCALE = {
    "specReplicasPath": ".spec.rollout.replicas",
    "statusReplicasPath": ".status.rollout.total",
    "labelSelectorPath": ".status.rolloutSelector",
}


def crd_manifest() -> dict[str, Any]:
    """The CRD as a dict."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["rj"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}, "scale": _SCALE},
                    "additionalPrinterColumns": _PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": _model_schema(RefitJobSpec, "v"),
                                "status": _model_schema(RefitJobStatus, "s"),
                            },
                        }
                    },
                }
            ],
        },
    }


def crd_yaml() -> str:
    """The CRD as YAML text, byte-for-byte stable across runs."""
    header = "# Generated by `refit crd` from operator/refit_operator/api/models.py; do not edit.\n"
    return header + yaml.safe_dump(
        crd_manifest(), sort_keys=True, default_flow_style=False, width=100
    )
