"""The Helm chart, checked by the real helm v4 binary and the Kubernetes 1.35 schemas.

Real: helm (``lint --strict``, ``template``, ``install --dry-run=client``), the chart,
kubernetes-validate's strict offline schemas.  Emulated: nothing (no API server is needed).
The helm fixture fails, never skips, when the binary is missing.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.binaries import ensure_tools
from tests.chart_tools import CHART, NAMESPACE, RELEASE, Helm, by_kind, one, schema_errors

NAMESPACED = {"watchNamespaces": ["team-a", "team-b"]}
CUSTOM = {
    "image": {
        "repository": "registry.example.com:5000/ml/refit",
        "tag": "1.2.3-cuda",
        "pullPolicy": "Always",
    },
    "resources": {"requests": {"cpu": "250m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    "livenessPort": 9090,
    "serviceAccount": {"create": True, "name": "refit-bot", "annotations": {"team": "rl"}},
    "podLabels": {"cost-center": "rl"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops"}],
    "extraArgs": ["--verbose"],
    "stopSignalSupported": True,
}
VALUE_SETS = {"default": None, "namespaced": NAMESPACED, "custom": CUSTOM}


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(ensure_tools().helm, tmp_path_factory.mktemp("helm-home"))


def _operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    containers = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    return dict(containers[0])


def _rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _chart_version() -> str:
    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_strict_passes(helm: Helm, tmp_path: Path, name: str) -> None:
    args = ["lint", "--strict", str(CHART)]
    if VALUE_SETS[name] is not None:
        values_file = tmp_path / "values.yaml"
        values_file.write_text(yaml.safe_dump(VALUE_SETS[name]))
        args += ["--values", str(values_file)]
    done = helm.run(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_objects_pass_the_kubernetes_schema(helm: Helm, tmp_path: Path, name: str) -> None:
    objects = helm.render(VALUE_SETS[name], tmp_path)
    assert objects
    assert schema_errors(objects) == []


def test_schema_check_catches_a_misspelt_field(helm: Helm, tmp_path: Path) -> None:
    # Guards the guard: the strict schema must notice an unknown field, or the test above
    # would pass on anything.
    deployment = copy.deepcopy(one(helm.render(None, tmp_path), "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFS"] = True
    (error,) = schema_errors([deployment])
    assert "readOnlyRootFS" in error


def test_default_deployment(helm: Helm, tmp_path: Path) -> None:
    objects = helm.render(None, tmp_path)
    deployment = one(objects, "Deployment")
    assert deployment["metadata"]["namespace"] == NAMESPACE
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    container = _operator_container(objects)
    assert container["image"] == f"ghcr.io/kube-refit/refit:{_chart_version()}"
    assert container["command"] == ["refit"]
    assert container["args"] == ["operator", "--liveness=http://0.0.0.0:8080/healthz"]
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    assert [p["containerPort"] for p in container["ports"] if p["name"] == probe["port"]] == [8080]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}
    assert container["resources"]["limits"]["memory"] == "512Mi"
    # The pod selector must match the pod template, or the Deployment never gets a pod.
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_default_rbac_is_cluster_wide(helm: Helm, tmp_path: Path) -> None:
    objects = helm.render(None, tmp_path)
    assert by_kind(objects, "Role") == []
    assert by_kind(objects, "RoleBinding") == []
    rules = _rules(one(objects, "ClusterRole"))
    assert ("", "namespaces", "watch") in rules
    assert ("refit.dev", "refitjobs/status", "patch") in rules
    assert ("", "pods", "create") in rules
    binding = one(objects, "ClusterRoleBinding")
    account = one(objects, "ServiceAccount")
    assert binding["roleRef"]["name"] == one(objects, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def test_namespaced_mode_grants_only_the_watched_namespaces(helm: Helm, tmp_path: Path) -> None:
    objects = helm.render(NAMESPACED, tmp_path)
    # Cluster-wide, the operator may only read CRDs: no namespaced resource, no namespaces.
    assert {r for _, r, _ in _rules(one(objects, "ClusterRole"))} == {"customresourcedefinitions"}
    roles = by_kind(objects, "Role")
    bindings = by_kind(objects, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for role in roles:
        assert ("", "configmaps", "patch") in _rules(role)
        assert ("refit.dev", "refitjobs", "watch") in _rules(role)
    account = one(objects, "ServiceAccount")["metadata"]["name"]
    for binding in bindings:
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": roles[0]["metadata"]["name"],
        }
        assert binding["subjects"][0]["name"] == account
        assert binding["subjects"][0]["namespace"] == NAMESPACE
    args = _operator_container(objects)["args"]
    assert args[2:] == ["--namespace=team-a", "--namespace=team-b"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rbac_has_no_wildcards_secrets_or_peering(helm: Helm, tmp_path: Path, name: str) -> None:
    objects = helm.render(VALUE_SETS[name], tmp_path)
    roles = by_kind(objects, "ClusterRole") + by_kind(objects, "Role")
    assert roles
    for group, resource, verb in set().union(*(_rules(r) for r in roles)):
        assert "*" not in (group, resource, verb)
        assert resource not in {"secrets", "nodes", "kopfpeerings", "clusterkopfpeerings"}
        # Workers' pods are deleted and recreated, never edited in bulk.
        assert verb not in {"deletecollection", "escalate", "bind", "impersonate"}


def test_custom_image_resources_and_account(helm: Helm, tmp_path: Path) -> None:
    objects = helm.render(CUSTOM, tmp_path)
    container = _operator_container(objects)
    assert container["image"] == "registry.example.com:5000/ml/refit:1.2.3-cuda"
    assert container["imagePullPolicy"] == "Always"
    assert container["resources"] == CUSTOM["resources"]
    assert container["args"] == [
        "operator",
        "--liveness=http://0.0.0.0:9090/healthz",
        "--stop-signal-supported",
        "--verbose",
    ]
    assert container["ports"][0]["containerPort"] == 9090
    account = one(objects, "ServiceAccount")
    assert account["metadata"]["name"] == "refit-bot"
    assert account["metadata"]["annotations"] == {"team": "rl"}
    pod_template = one(objects, "Deployment")["spec"]["template"]
    assert pod_template["metadata"]["labels"]["cost-center"] == "rl"
    assert pod_template["spec"]["serviceAccountName"] == "refit-bot"
    assert pod_template["spec"]["tolerations"] == CUSTOM["tolerations"]


def test_existing_service_account_gets_the_rbac(helm: Helm, tmp_path: Path) -> None:
    objects = helm.render({"serviceAccount": {"create": False, "name": "platform-sa"}}, tmp_path)
    assert by_kind(objects, "ServiceAccount") == []
    assert one(objects, "ClusterRoleBinding")["subjects"][0]["name"] == "platform-sa"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param(
            {"watchNamespaces": ["Team_A"]}, "'Team_A' does not match pattern", id="ns-name"
        ),
        pytest.param({"watchNamespaces": ["a", "a"]}, "/watchNamespaces", id="ns-twice"),
        pytest.param({"livenessPort": 0}, "/livenessPort", id="port-zero"),
        pytest.param({"stopSignalSupported": "yes"}, "/stopSignalSupported", id="not-bool"),
        pytest.param({"livenessPort": "8080"}, "/livenessPort", id="port-string"),
        pytest.param(
            {"image": {"repository": "Bad Repo", "tag": "", "pullPolicy": "Always"}},
            "'Bad Repo'",
            id="repository",
        ),
        pytest.param(
            {"image": {"repository": "r", "tag": "a b", "pullPolicy": "Always"}},
            "'a b'",
            id="tag",
        ),
        pytest.param(
            {"image": {"repository": "r", "tag": "", "pullPolicy": "Sometimes"}},
            "'/image/pullPolicy': value must be one of",
            id="pull-policy",
        ),
        pytest.param({"resources": {"limits": {"memory": "lots"}}}, "'lots'", id="quantity"),
        pytest.param({"replicas": 2}, "'replicas' not allowed", id="unknown-key"),
        pytest.param(
            {"serviceAccount": {"create": False}},
            "serviceAccount.name is required",
            id="account-without-name",
        ),
    ],
)
def test_bad_values_are_refused_by_name(
    helm: Helm, tmp_path: Path, values: dict[str, Any], message: str
) -> None:
    done = helm.template(values, tmp_path)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr
    assert done.stdout.strip() == ""


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (None, "every namespace"),
        (NAMESPACED, "It reconciles RefitJobs in: team-a, team-b."),
    ],
)
def test_notes_tell_the_next_steps(
    helm: Helm, tmp_path: Path, values: dict[str, Any] | None, expected: str
) -> None:
    done = helm.template(values, tmp_path)
    assert done.returncode == 0, done.stderr
    # `install --dry-run=client` renders NOTES.txt without touching a cluster.
    args = ["install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE]
    if values is not None:
        args += ["--values", str(tmp_path / "values.yaml")]
    notes = helm.run(*args)
    assert notes.returncode == 0, notes.stderr
    assert expected in notes.stdout
    assert "kubectl get rj -w" in notes.stdout
    assert f"helm uninstall {RELEASE}" in notes.stdout


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_operator_cli_accepts_the_rendered_arguments(helm: Helm, tmp_path: Path, name: str) -> None:
    # The chart and `refit operator` must agree on flags, or the pod crash-loops.
    from refit_operator.cli import build_parser

    values = VALUE_SETS[name] or {}
    container = _operator_container(helm.render(VALUE_SETS[name], tmp_path))
    args = build_parser().parse_args(container["args"])
    assert args.command == "operator"
    assert args.liveness == f"http://0.0.0.0:{values.get('livenessPort', 8080)}/healthz"
    assert (args.namespace or []) == values.get("watchNamespaces", [])
    assert args.stop_signal_supported is values.get("stopSignalSupported", False)
