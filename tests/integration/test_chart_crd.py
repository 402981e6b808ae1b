"""The chart ships the same RefitJob CRD as ``crds/refitjob.yaml``, and it is a valid one.

The chart renders ``charts/refit-operator/files/refitjob.yaml`` as a template (not from
``crds/``, which helm never upgrades), so the copy must match the generated CRD byte for
byte.  After regenerating the CRD:
``cp crds/refitjob.yaml charts/refit-operator/files/refitjob.yaml``.  ``crds.install`` and
``crds.keep`` decide whether the chart renders it and whether uninstall keeps it.

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
CHART_COPY = CHART / "files" / "refitjob.yaml"
COPY_STEP = f"cp {GENERATED.relative_to(REPO_ROOT)} {CHART_COPY.relative_to(REPO_ROOT)}"


@pytest.fixture(scope="module")
def rendered_crd(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    helm = Helm(ensure_tools().helm, tmp_path_factory.mktemp("helm-home"))
    tmp = tmp_path_factory.mktemp("values")
    done = helm.template(None, tmp)
    if done.returncode != 0:
        raise RuntimeError(f"helm template failed: {done.stderr}")
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


def test_rendered_crd_is_the_generated_one_with_helms_labels(rendered_crd: dict[str, Any]) -> None:
    generated = yaml.safe_load(GENERATED.read_text())
    assert {k: v for k, v in rendered_crd.items() if k != "metadata"} == {
        k: v for k, v in generated.items() if k != "metadata"
    }
    meta = rendered_crd["metadata"]
    assert meta["name"] == generated["metadata"]["name"]
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    # Kept by default: uninstalling the operator must not delete every RefitJob.
    assert meta["annotations"] == {"helm.sh/resource-policy": "keep"}


@pytest.mark.parametrize(
    ("values", "rendered", "kept"),
    [
        pytest.param({"crds": {"install": False}}, False, False, id="not-installed"),
        pytest.param({"crds": {"keep": False}}, True, False, id="not-kept"),
    ],
)
def test_crd_values(
    tmp_path_factory: pytest.TempPathFactory, values: dict[str, Any], rendered: bool, kept: bool
) -> None:
    helm = Helm(ensure_tools().helm, tmp_path_factory.mktemp("helm-home"))
    tmp = tmp_path_factory.mktemp("values")
    objects = helm.render(values, tmp)
    crds = [o for o in objects if o["kind"] == "CustomResourceDefinition"]
    assert len(crds) == int(rendered)
    for crd in crds:
        assert ("helm.sh/resource-policy" in (crd["metadata"].get("annotations") or {})) is kept
    # Nothing under crds/: helm would install it behind the template's back, never upgrade it.
    assert not (CHART / "crds").exists()
