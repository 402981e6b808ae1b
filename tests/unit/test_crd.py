"""The generated CRD: drift of the checked-in file, structure, and its CEL rules (pure).

The CEL rules are evaluated with cel-python (a real CEL interpreter) on manifests the
pydantic models accept and refuse, so the apiserver and the operator agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml
from tests.support.openapi_structural import walk

from refit_operator.api.crd import SchemaError, crd_manifest, crd_yaml, structural
from refit_operator.api.models import InvalidSpecError, parse_spec
from refit_operator.api.podtemplate import pod_template_schema

ROOT = Path(__file__).resolve().parents[2]
CHECKED_IN = ROOT / "crds" / "refitjob.yaml"


def test_checked_in_crd_matches_the_models() -> None:
    assert CHECKED_IN.read_text() == crd_yaml(), (
        "crds/refitjob.yaml drifted from the models; regenerate: refit crd > crds/refitjob.yaml"
    )


def test_refit_crd_command_prints_it() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "refit_operator.cli", "crd"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={"PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'worker'}", "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout == crd_yaml()
    assert crd_yaml() == crd_yaml()  # deterministic


def test_crd_is_a_valid_kubernetes_object() -> None:
    kubernetes_validate.validate(crd_manifest(), "1.30", strict=True)


INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]


def test_schema_is_structural() -> None:
    version = crd_manifest()["spec"]["versions"][0]
    int_or_string = 0
    for path, node in walk(version["schema"]["openAPIV3Schema"]):
        if node.get("x-kubernetes-int-or-string"):
            # The one union a structural schema allows, spelled exactly so.
            assert node["anyOf"] == INT_OR_STRING and "type" not in node, path
            int_or_string += 1
        else:
            assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
            assert "anyOf" not in node, path
        assert not {"$ref", "oneOf", "allOf", "title", "const"} & set(node), path
        assert not ("properties" in node and "additionalProperties" in node), path
        if node.get("x-kubernetes-list-type") == "map":
            # A list-map key is required or defaulted, or the apiserver refuses the CRD.
            items = node["items"]
            for key in node["x-kubernetes-list-map-keys"]:
                assert key in items.get("required", ()) or "default" in items["properties"][key], (
                    path,
                    key,
                )
    # Short-form resources (requests, limits of each role) and the templates' quantities.
    assert int_or_string > 4


def test_the_crd_fits_kubectl_apply_and_etcd() -> None:
    # kubectl's client-side apply keeps the whole object in an annotation (262144 bytes at
    # most); etcd takes requests up to 1.5 MiB.  Two embedded PodSpecs must leave room.
    compact = json.dumps(crd_manifest(), separators=(",", ":"))
    assert len(compact) < 200_000, len(compact)


def test_each_role_embeds_the_upstream_pod_template() -> None:
    spec = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for role in ("policy", "rollout"):
        node = spec["properties"][role]["properties"]["template"]
        upstream = pod_template_schema()
        assert node["properties"] == upstream["properties"], role
        assert node["required"] == upstream["required"] if "required" in upstream else True
        assert node["nullable"] is True and "x-kubernetes-preserve-unknown-fields" not in node
        containers = node["properties"]["spec"]["properties"]["containers"]
        assert containers["x-kubernetes-list-map-keys"] == ["name"]


def test_conditions_are_a_list_map_keyed_by_type() -> None:
    root = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    node = root["properties"]["status"]["properties"]["conditions"]
    assert (node["x-kubernetes-list-type"], node["x-kubernetes-list-map-keys"]) == ("map", ["type"])
    assert {"type", "status", "reason", "lastTransitionTime"} <= set(node["items"]["required"])
    assert "observedGeneration" in node["items"]["properties"]


def test_names_columns_and_status() -> None:
    spec = crd_manifest()["spec"]
    assert spec["names"]["shortNames"] == ["rj"]
    assert spec["scope"] == "Namespaced"
    version = spec["versions"][0]
    assert version["subresources"] == {
        "status": {},
        # kubectl scale / autoscale and an HPA drive the rollout replica count.
        "scale": {
            "specReplicasPath": ".spec.rollout.replicas",
            "statusReplicasPath": ".status.rollout.total",
            "labelSelectorPath": ".status.rolloutSelector",
        },
    }
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase"
    assert columns["Age"] == ".metadata.creationTimestamp"
    assert {"Policy", "Rollout", "Refits"} <= set(columns)
    root = version["schema"]["openAPIV3Schema"]
    for path, kind in [
        *(
            (p, c["type"])
            for c in version["additionalPrinterColumns"]
            for p in [c["jsonPath"]]
            if not p.startswith(".metadata")
        ),
        (".spec.rollout.replicas", "integer"),
        (".status.rollout.total", "integer"),
        (".status.rolloutSelector", "string"),
    ]:
        assert _schema_at(root, path)["type"] == kind, path


def _schema_at(root: dict[str, Any], path: str) -> dict[str, Any]:
    """The schema node a ``.a.b`` JSON path names (KeyError: the path names nothing)."""
    node = root
    for part in path.strip(".").split("."):
        node = node["properties"][part]
    return node


def _rules(prop: str) -> list[dict[str, str]]:
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules: list[dict[str, str]] = schema["properties"]["spec"]["properties"][prop][
        "x-kubernetes-validations"
    ]
    return rules


def _cel(rule: str, obj: dict[str, Any]) -> bool:
    env = celpy.Environment()
    return bool(env.program(env.compile(rule)).evaluate({"self": celpy.json_to_cel(obj)}))


@pytest.mark.parametrize(
    ("prop", "value"),
    [
        ("preemption", {"signal": "SIGUSR1", "injection": "stopSignal", "gracePeriodSeconds": 5}),
        ("preemption", {"signal": "usr1", "injection": "stopSignal", "gracePeriodSeconds": 5}),
        ("preemption", {"signal": "usr1", "injection": "preStop", "gracePeriodSeconds": 5}),
        ("preemption", {"signal": "SIGHUP", "injection": "auto", "gracePeriodSeconds": 5}),
        ("weights", {"synthetic": {"layers": 1}}),
        ("weights", {"safetensors": {"claimName": "c"}}),
        ("weights", {}),
        ("weights", {"synthetic": {}, "safetensors": {"claimName": "c"}}),
    ],
)
def test_cel_rules_agree_with_the_models(prop: str, value: dict[str, Any]) -> None:
    try:
        parse_spec({"image": "i", prop: value})
        model_ok = True
    except InvalidSpecError:
        model_ok = False
    cel_ok = all(_cel(r["rule"], value) for r in _rules(prop))
    assert cel_ok == model_ok, (prop, value)


def test_unsupported_schema_is_refused() -> None:
    with pytest.raises(SchemaError, match="only Optional"):
        structural({"anyOf": [{"type": "string"}, {"type": "integer"}]}, {}, "x")
    with pytest.raises(SchemaError, match="'oneOf'"):
        structural({"type": "object", "oneOf": []}, {}, "x")


def test_generated_yaml_parses_back() -> None:
    text = crd_yaml()
    assert yaml.safe_load(text) == crd_manifest()
