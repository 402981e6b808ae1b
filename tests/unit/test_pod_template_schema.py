"""The checked-in PodTemplateSpec schema (what the CRD embeds for each role's ``template``)
agrees with a second source, offline: the Kubernetes 1.36 schemas ``kubernetes-validate``
ships.  Field by field: the same properties, the same required fields, the same list-map
keys and the same types, quantities and int-or-strings as ``x-kubernetes-int-or-string``.
(``tests/cluster/test_platform.py`` shows it is exactly what the tier's apiserver serves.)
Also the conversion rules of ``tests/support/openapi_structural.py`` on small inputs, and
the operator's own check of a template against the schema.

Real: the checked-in schema, kubernetes-validate's schema files, the converter.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from tests.support.openapi_structural import (
    QUANTITY_PATTERN,
    ConversionError,
    convert,
    pod_template_schema,
)

from refit_operator.api import podtemplate

SCHEMAS = (
    Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / "v1.36.0-local-strict"
)
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
UNIONS = {
    "io.k8s.apimachinery.pkg.api.resource.Quantity",
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString",
}


@cache
def _defs() -> dict[str, Any]:
    defs: dict[str, Any] = json.loads((SCHEMAS / "_definitions.json").read_text())["$defs"]
    return defs


def _resolve(node: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    ref = node.get("$ref")
    if ref is None:
        return None, node
    name = ref.rsplit("/", 1)[-1]
    return name, _defs()[name]


def _types(node: dict[str, Any]) -> set[str]:
    kind = node.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind}
    return kinds - {"null", None}


def _compare(ours: dict[str, Any], theirs: dict[str, Any], where: str, out: list[str]) -> None:
    name, theirs = _resolve(theirs)
    if name in UNIONS:
        if not ours.get("x-kubernetes-int-or-string"):
            out.append(f"{where}: {name} is not int-or-string")
        return
    if name == OBJECT_META:  # the operator's restriction: labels and annotations only
        if set(ours["properties"]) != {"labels", "annotations"}:
            out.append(f"{where}: metadata keeps {sorted(ours['properties'])}")
        return
    if {ours.get("type")} != _types(theirs):
        out.append(f"{where}: type {ours.get('type')} vs {_types(theirs)}")
        return
    if set(ours.get("required", ())) != set(theirs.get("required", ())):
        out.append(f"{where}: required {ours.get('required')} vs {theirs.get('required')}")
    if ours.get("x-kubernetes-list-map-keys") != theirs.get("x-kubernetes-list-map-keys"):
        out.append(f"{where}: list-map keys differ")
    props, their_props = ours.get("properties") or {}, theirs.get("properties") or {}
    if set(props) != set(their_props):
        out.append(f"{where}: properties {sorted(set(props) ^ set(their_props))} differ")
    for key in set(props) & set(their_props):
        _compare(props[key], their_props[key], f"{where}.{key}", out)
    if "items" in ours:
        _compare(ours["items"], theirs["items"], f"{where}[]", out)
    if isinstance(ours.get("additionalProperties"), dict):
        _compare(ours["additionalProperties"], theirs["additionalProperties"], f"{where}{{}}", out)


def test_the_checked_in_schema_agrees_with_kubernetes_validate_1_36() -> None:
    theirs = json.loads((SCHEMAS / "podtemplatespec-v1.json").read_text())
    problems: list[str] = []
    _compare(podtemplate.pod_template_schema(), theirs, "template", problems)
    assert problems == []
    # The release whose apiserver served the checked-in schema.
    shipped = Path(podtemplate.__file__).parent / "schemas" / podtemplate.SCHEMA_FILE
    assert json.loads(shipped.read_text())["kubernetesVersion"].startswith("v1.36.")


def test_the_comparison_notices_a_difference() -> None:
    # Guards the guard: one property dropped, one list-map key changed.
    ours = json.loads(json.dumps(podtemplate.pod_template_schema()))
    del ours["properties"]["spec"]["properties"]["priorityClassName"]
    ours["properties"]["spec"]["properties"]["containers"]["x-kubernetes-list-map-keys"] = ["image"]
    problems: list[str] = []
    _compare(ours, json.loads((SCHEMAS / "podtemplatespec-v1.json").read_text()), "t", problems)
    assert any("priorityClassName" in p for p in problems)
    assert any("t.spec.containers: list-map keys differ" in p for p in problems)


SMALL = {
    "io.k8s.api.core.v1.PodTemplateSpec": {
        "type": "object",
        "properties": {
            "metadata": {"allOf": [{"$ref": "#/components/schemas/" + OBJECT_META}]},
            "spec": {"$ref": "#/components/schemas/Spec"},
        },
    },
    OBJECT_META: {"type": "object", "properties": {"name": {"type": "string"}}},
    "Spec": {
        "type": "object",
        "required": ["containers"],
        "properties": {
            "containers": {
                "type": "array",
                "items": {"$ref": "#/components/schemas/Port"},
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["port", "protocol"],
                "x-kubernetes-patch-strategy": "merge",
            },
            "cpu": {"$ref": "#/components/schemas/io.k8s.apimachinery.pkg.api.resource.Quantity"},
            "grace": {"type": "integer", "format": "int64", "default": 30},
            "free": {"type": "object"},
        },
    },
    "Port": {
        "type": "object",
        "required": ["port"],
        "properties": {
            "port": {"type": "integer", "format": "int32"},
            "protocol": {"type": "string", "default": "TCP", "enum": ["TCP", "UDP"]},
        },
    },
    "io.k8s.apimachinery.pkg.api.resource.Quantity": {
        "oneOf": [{"type": "string"}, {"type": "number"}]
    },
}


def test_the_conversion_rules_on_a_small_schema() -> None:
    out = pod_template_schema(SMALL)
    assert out["properties"]["metadata"]["properties"].keys() == {"labels", "annotations"}
    spec = out["properties"]["spec"]
    cpu = spec["properties"]["cpu"]
    assert cpu == {
        "x-kubernetes-int-or-string": True,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN,
    }
    containers = spec["properties"]["containers"]
    assert "x-kubernetes-patch-strategy" not in containers
    port = containers["items"]["properties"]
    assert port["protocol"] == {"type": "string", "enum": ["TCP", "UDP"], "default": "TCP"}
    assert spec["properties"]["grace"] == {"type": "integer", "format": "int64"}  # no default
    assert spec["properties"]["free"]["x-kubernetes-preserve-unknown-fields"] is True


def test_a_union_or_an_undefaultable_map_key_is_refused() -> None:
    with pytest.raises(ConversionError, match="a union"):
        convert({}, {"oneOf": [{"type": "string"}, {"type": "boolean"}]}, "x")
    bad = json.loads(json.dumps(SMALL))
    del bad["Port"]["properties"]["protocol"]["default"]
    with pytest.raises(ConversionError, match="'protocol' has no default"):
        pod_template_schema(bad)


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ({"spec": {"containers": [{"name": "w", "resources": {"limits": {"cpu": 1}}}]}}, None),
        (
            {"spec": {"containers": [{"name": "w", "resources": {"limits": {"cpu": 1.5}}}]}},
            "must be an integer or a string (got 1.5)",
        ),
        ({"spec": {"containers": [{"name": "w", "resources": {"limits": {"cpu": "-1"}}}]}}, None),
        (
            {
                "spec": {
                    "containers": [
                        {
                            "name": "w",
                            "ports": [
                                {"containerPort": 80},
                                {"containerPort": 80, "protocol": "TCP"},
                            ],
                        }
                    ]
                }
            },
            "ports[1]: duplicate entry",
        ),
        (
            {
                "spec": {
                    "containers": [
                        {
                            "name": "w",
                            "ports": [
                                {"containerPort": 80},
                                {"containerPort": 80, "protocol": "UDP"},
                            ],
                        }
                    ]
                }
            },
            None,
        ),
        (
            {"spec": {"containers": [{"name": "w"}], "activeDeadlineSeconds": 2**63}},
            "out of the int64 range",
        ),
        ({"spec": {"containers": [{"name": "w"}], "restartPolicy": "Sometimes"}}, "must be one of"),
        (
            {"spec": {"containers": [{"name": "w"}], "hostNetwork": "yes"}},
            "must be a boolean (got 'yes')",
        ),
        (
            {
                "spec": {
                    "containers": [{"name": "w", "ports": [{"containerPort": 80}]}],
                    "volumes": None,
                }
            },
            "volumes: must not be null",
        ),
    ],
)
def test_the_operator_checks_a_template_as_the_apiserver_does(
    template: dict[str, Any], problem: str | None
) -> None:
    problems = podtemplate.template_problems(template)
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems


def test_a_set_list_refuses_a_value_twice() -> None:
    node = {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "integer"}}
    assert podtemplate.schema_problems(node, [1, 2, 1], "x") == ["x[2]: duplicate entry 1"]
    assert podtemplate.schema_problems(node, [1, 2], "x") == []
