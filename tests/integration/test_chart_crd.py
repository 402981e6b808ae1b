"""The chart ships the same RefitJob CRD as ``crds/refitjob.yaml``, and it is a valid one.

Helm installs ``charts/refit-operator/crds/`` before the templates and never upgrades it,
so the copy must match the generated CRD byte for byte.  After regenerating the CRD:
``cp crds/refitjob.yaml charts/refit-operator/crds/refitjob.yaml``.

Real: helm v4 (``template --include-crds``), kubernetes-validate's strict 1.35 schema.
Emulated: nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from tests.binaries import REPO_ROOT, ensure_tools
from tests.chart_tools import CHART, Helm, one, schema_errors

GENERATED = REPO_ROOT / "crds" / "refitjob.yaml"
CHART_COPY = CHART / "crds" / "refitjob.yaml"
COPY_STEP = f"cp {GENERATED.relative_to(REPO_ROOT)} {CHART_COPY.relative_to(REPO_ROOT)}"


@pytest.fixture(scope="module")
def rendered_crd(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    helm = Helm(ensure_tools().helm, tmp_path_factory.mktemp("helm-home"))
    tmp = tmp_path_factory.mktemp("values")
    done = helm.template(None, tmp, "--include-crds")
    if done.returncode != 0:
        raise RuntimeError(f"helm template --include-crds failed: {done.stderr}")
    objects = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    return one(objects, "CustomResourceDefinition")


def test_chart_crd_is_the_generated_crd() -> None:
    assert GENERATED.is_file(), f"{GENERATED} is missing: the operator's CRD is not generated"
    assert CHART_COPY.is_file(), f"{CHART_COPY} is missing; run: {COPY_STEP}"
    assert CHART_COPY.read_bytes() == GENERATED.read_bytes(), (
        f"the chart's CRD differs from the generated one; run: {COPY_STEP}"
    )


def test_crd_passes_the_kubernetes_schema(rendered_crd: dict[str, Any]) -> None:
    assert schema_errors([rendered_crd]) == []


def test_crd_names_follow_the_contract(rendered_crd: dict[str, Any]) -> None:
    spec = rendered_crd["spec"]
    assert rendered_crd["metadata"]["name"] == "refitjobs.refit.dev"
    assert spec["group"] == "refit.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "RefitJob"
    assert spec["names"]["plural"] == "refitjobs"
    assert "rj" in spec["names"]["shortNames"]
    (version,) = [v for v in spec["versions"] if v["name"] == "v1alpha1"]
    assert version["served"] and version["storage"]
    assert "status" in version["subresources"]


def test_schema_check_catches_a_broken_crd(rendered_crd: dict[str, Any]) -> None:
    # Guards the guard: a misplaced field must fail validation.  The version schema is
    # replaced by a trivial one, so the only fault left is the planted one.
    versions = [
        {**v, "schema": {"openAPIV3Schema": {"type": "object"}}}
        for v in rendered_crd["spec"]["versions"]
    ]
    spec = {**rendered_crd["spec"], "versions": versions}
    assert schema_errors([{**rendered_crd, "spec": spec}]) == []
    (error,) = schema_errors([{**rendered_crd, "spec": {**spec, "scopes": "Namespaced"}}])
    assert "'scopes' was unexpected" in error
