"""Every manifest in ``examples/`` is valid: against the pydantic models (through the same
loader ``refit run`` uses) and against the generated CRD — its openAPIV3Schema (checked
with jsonschema) and its CEL rules (evaluated with cel-python), as an API server would.
Pure: no API, no processes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml

from refit_operator.api.crd import crd_manifest
from refit_operator.local.command import load_manifest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def _schema() -> dict[str, Any]:
    version = crd_manifest()["spec"]["versions"][0]
    return dict(version["schema"]["openAPIV3Schema"])


def _defaulted(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting, as the API server applies it before validation: a missing
    property with a ``default`` gets it, inside every object that is present."""
    if not isinstance(obj, dict):
        return obj
    out = dict(obj)
    for key, sub in (schema.get("properties") or {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = _defaulted(sub, out[key])
    return out


def _validate(manifest: dict[str, Any]) -> None:
    # OpenAPI v3.0 schemas use draft-4 semantics (a boolean exclusiveMinimum, for one).
    jsonschema.Draft4Validator(_schema()).validate(manifest)


def _cel_rules(schema: dict[str, Any], obj: Any, path: str = "") -> Iterator[tuple[str, str, Any]]:
    """(path, rule, value) for every CEL rule whose node is present in ``obj``."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule["rule"], obj
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in obj:
                yield from _cel_rules(sub, obj[key], f"{path}.{key}")


def _cel_violations(obj: dict[str, Any]) -> list[str]:
    env = celpy.Environment()
    bad = []
    for path, rule, value in _cel_rules(_schema(), _defaulted(_schema(), obj)):
        program = env.program(env.compile(rule))
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            bad.append(f"{path or '.'}: {rule}")
    return bad


def test_there_are_local_benchmark_and_cluster_examples() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"local.yaml", "benchmark-1gib.yaml", "cluster-gpu.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid_for_models_and_crd(path: Path) -> None:
    manifest, spec = load_manifest(path)  # the models, and the job name rules
    _validate(manifest)
    assert _cel_violations(manifest) == []
    assert spec.transfer.bucket_bytes > 0


def test_the_crd_check_rejects_what_it_should() -> None:
    # The checks above could pass on anything; show each one refusing a bad manifest.
    manifest = yaml.safe_load(EXAMPLES[0].read_text())
    unknown = copy.deepcopy(manifest)
    unknown["spec"]["transfer"]["bucketSize"] = "lots"
    with pytest.raises(jsonschema.ValidationError):
        _validate(unknown)
    both = copy.deepcopy(manifest)
    both["spec"]["weights"] = {"synthetic": {}, "safetensors": {"claimName": "c"}}
    assert any("weights" in v for v in _cel_violations(both))


def test_the_gpu_example_shapes_its_pods_with_the_template() -> None:
    # What docs/cluster.md points at: shm in memory, IPC_LOCK, pull secrets, a Kueue queue.
    manifest, spec = load_manifest(EXAMPLES[[p.name for p in EXAMPLES].index("cluster-gpu.yaml")])
    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] and spec.suspend
    for role in (spec.policy, spec.rollout):
        assert role.template is not None
        pod = role.template["spec"]
        assert pod["imagePullSecrets"] and pod["volumes"][0]["emptyDir"]["medium"] == "Memory"
        worker = pod["containers"][0]
        assert worker["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert {"name": "shm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
        assert role.resources.limits["nvidia.com/gpu"] == 1  # unquoted, an integer
