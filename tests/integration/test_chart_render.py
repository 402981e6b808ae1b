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
SINGLE = {"replicaCount": 1, "leaderElection": {"enabled": False}}
CUSTOM = {
    "image": {
        "repository": "registry.example.com:5000/ml/refit",
        "tag": "1.2.3-cuda",
        "pullPolicy": "Always",
    },
    "resources": {"requests": {"cpu": "250m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    "healthPort": 9091,
    "metrics": {
        "port": 9090,
        "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}},
    },
    "leaderElection": {"leaseDuration": 30, "renewDeadline": 20, "retryPeriod": 4},
    "serviceAccount": {"create": True, "name": "refit-bot", "annotations": {"team": "rl"}},
    "podLabels": {"cost-center": "rl"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops"}],
    "extraArgs": ["--verbose"],
    "stopSignalSupported": True,
}
VALUE_SETS = {"default": None, "namespaced": NAMESPACED, "custom": CUSTOM, "single": SINGLE}


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


#: The operator's own ClusterRole (and Roles, in namespaced mode) are named like this; the
#: chart's other roles are for the leader Lease and for users.
OPERATOR_ROLE = f"{RELEASE}-refit-operator"


def _named(objects: list[dict[str, Any]], kind: str, name: str) -> list[dict[str, Any]]:
    return [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]


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
    # The Prometheus Operator's ServiceMonitor has no schema here (a CRD of its own); its
    # fields are checked in test_custom_image_resources_and_account.
    assert schema_errors([o for o in objects if o["kind"] != "ServiceMonitor"]) == []


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
    # Two replicas, one leading; a new pod starts (as a standby) before an old one stops.
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = deployment["spec"]["template"]["spec"]
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    container = _operator_container(objects)
    assert container["image"] == f"ghcr.io/kube-refit/refit:{_chart_version()}"
    assert container["command"] == ["refit"]
    assert container["args"] == [
        "operator",
        "--health-probe-bind-address=:8081",
        "--metrics-bind-address=:8080",
        "--leader-elect",
        f"--leader-election-id={RELEASE}-refit-operator",
        "--leader-elect-lease-duration=15",
        "--leader-elect-renew-deadline=10",
        "--leader-elect-retry-period=2",
    ]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 8081, "metrics": 8080}
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert container[probe]["httpGet"] == {"path": path, "port": "health"}
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
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
    assert _named(objects, "Role", OPERATOR_ROLE) == []
    assert _named(objects, "RoleBinding", OPERATOR_ROLE) == []
    (role,) = _named(objects, "ClusterRole", OPERATOR_ROLE)
    rules = _rules(role)
    # kopf's scanning is off: it watches RefitJobs in all namespaces, never Namespaces.
    assert ("", "namespaces", "watch") not in rules
    assert ("refit.dev", "refitjobs", "watch") in rules
    assert ("refit.dev", "refitjobs/status", "patch") in rules
    assert ("", "pods", "create") in rules
    binding = one(objects, "ClusterRoleBinding")
    account = one(objects, "ServiceAccount")
    assert binding["roleRef"]["name"] == OPERATOR_ROLE
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def test_namespaced_mode_grants_only_the_watched_namespaces(helm: Helm, tmp_path: Path) -> None:
    objects = helm.render(NAMESPACED, tmp_path)
    # Cluster-wide, the operator may only get Nodes (a pod lost with its node): no
    # namespaced resource, no namespaces, no CRDs (kopf finds its resources by discovery).
    (cluster_role,) = _named(objects, "ClusterRole", OPERATOR_ROLE)
    assert {r for _, r, _ in _rules(cluster_role)} == {"nodes"}
    roles = _named(objects, "Role", OPERATOR_ROLE)
    bindings = _named(objects, "RoleBinding", OPERATOR_ROLE)
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
    assert args[-2:] == ["--namespace=team-a", "--namespace=team-b"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rbac_has_no_wildcards_secrets_or_peering(helm: Helm, tmp_path: Path, name: str) -> None:
    objects = helm.render(VALUE_SETS[name], tmp_path)
    users = {
        f"{RELEASE}-refit-operator-refitjob-editor",
        f"{RELEASE}-refit-operator-refitjob-viewer",
    }
    roles = [
        r
        for r in by_kind(objects, "ClusterRole") + by_kind(objects, "Role")
        if r["metadata"]["name"] not in users
    ]
    assert roles
    for group, resource, verb in set().union(*(_rules(r) for r in roles)):
        assert "*" not in (group, resource, verb)
        assert resource not in {"kopfpeerings", "clusterkopfpeerings"}
        # The job's signing key: created, and listed by its job's label; never read by name.
        assert resource != "secrets" or verb in {"list", "create"}, (resource, verb)
        # Nodes are read by name to tell a pod lost with its node, never written.
        assert resource != "nodes" or verb == "get", (resource, verb)
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
        "--health-probe-bind-address=:9091",
        "--metrics-bind-address=:9090",
        "--leader-elect",
        f"--leader-election-id={RELEASE}-refit-operator",
        "--leader-elect-lease-duration=30",
        "--leader-elect-renew-deadline=20",
        "--leader-elect-retry-period=4",
        "--stop-signal-supported",
        "--verbose",
    ]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "health": 9091,
        "metrics": 9090,
    }
    monitor = one(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
    ]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"].items()
    )
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
        pytest.param({"healthPort": 0}, "/healthPort", id="port-zero"),
        pytest.param({"stopSignalSupported": "yes"}, "/stopSignalSupported", id="not-bool"),
        pytest.param({"metrics": {"port": "8080"}}, "/metrics/port", id="port-string"),
        # The pre-0.2 name of the probe port: refused by name, not silently ignored.
        pytest.param({"livenessPort": 8080}, "'livenessPort' not allowed", id="old-port-key"),
        pytest.param(
            {"leaderElection": {"enabled": False}},
            "replicaCount > 1 needs leaderElection.enabled",
            id="replicas-without-election",
        ),
        pytest.param(
            {"leaderElection": {"leaseDuration": 10, "renewDeadline": 10}},
            "leaseDuration must be longer than leaderElection.renewDeadline",
            id="lease-not-longer-than-deadline",
        ),
        pytest.param(
            {"leaderElection": {"renewDeadline": 2.4, "retryPeriod": 2}},
            "renewDeadline must be longer than 1.2 x leaderElection.retryPeriod",
            id="deadline-within-retries",
        ),
        pytest.param(
            {"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}},
            "metrics.serviceMonitor.enabled needs metrics.enabled",
            id="monitor-without-metrics",
        ),
        pytest.param(
            {"metrics": {"serviceMonitor": {"interval": "often"}}},
            "'often' does not match",
            id="monitor-interval",
        ),
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
        pytest.param({"crds": {"install": "yes"}}, "/crds/install", id="crds-not-bool"),
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
    assert args.health_probe_bind_address == f"0.0.0.0:{values.get('healthPort', 8081)}"
    assert args.metrics_bind_address == f"0.0.0.0:{values.get('metrics', {}).get('port', 8080)}"
    election = values.get("leaderElection", {})
    assert args.leader_elect is election.get("enabled", True)
    if args.leader_elect:
        assert args.leader_election_id == f"{RELEASE}-refit-operator"
        assert args.leader_elect_lease_duration == election.get("leaseDuration", 15)
        assert args.leader_elect_renew_deadline == election.get("renewDeadline", 10)
        assert args.leader_elect_retry_period == election.get("retryPeriod", 2)
    assert (args.namespace or []) == values.get("watchNamespaces", [])
    assert args.stop_signal_supported is values.get("stopSignalSupported", False)


def test_user_roles_aggregate_into_the_builtin_roles(helm: Helm, tmp_path: Path) -> None:
    objects = helm.render(None, tmp_path)
    (editor,) = _named(objects, "ClusterRole", f"{OPERATOR_ROLE}-refitjob-editor")
    (viewer,) = _named(objects, "ClusterRole", f"{OPERATOR_ROLE}-refitjob-viewer")
    aggregate = "rbac.authorization.k8s.io/aggregate-to-"
    assert {k for k, v in editor["metadata"]["labels"].items() if v == "true"} == {
        aggregate + "admin",
        aggregate + "edit",
    }
    assert {k for k, v in viewer["metadata"]["labels"].items() if v == "true"} == {
        aggregate + "view"
    }
    assert ("refit.dev", "refitjobs", "create") in _rules(editor)
    assert ("refit.dev", "refitjobs", "delete") in _rules(editor)
    # Status is the operator's: users read it and never write it.
    assert {v for g, r, v in _rules(editor) if r == "refitjobs/status"} == {"get"}
    assert {v for _, _, v in _rules(viewer)} == {"get", "list", "watch"}
    off = helm.render({"rbac": {"aggregateRoles": False}}, tmp_path)
    assert _named(off, "ClusterRole", f"{OPERATOR_ROLE}-refitjob-editor") == []


def test_single_replica_without_election_recreates(helm: Helm, tmp_path: Path) -> None:
    objects = helm.render(SINGLE, tmp_path)
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert "--leader-elect" not in _operator_container(objects)["args"]
    # A budget on one replica would block every drain; no Lease, so no Lease rights.
    assert by_kind(objects, "PodDisruptionBudget") == []
    assert _named(objects, "Role", f"{OPERATOR_ROLE}-leader-election") == []


def test_default_budget_and_metrics_service(helm: Helm, tmp_path: Path) -> None:
    objects = helm.render(None, tmp_path)
    pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    budget = one(objects, "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service = one(objects, "Service")
    assert service["metadata"]["name"] == f"{OPERATOR_ROLE}-metrics"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert by_kind(objects, "ServiceMonitor") == []  # off unless asked for
