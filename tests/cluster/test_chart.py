"""The chart on a real control plane: ``helm install`` establishes the CRD, the operator
runs as a local process on the chart's ServiceAccount token (``kubectl create token``), so
every right it uses is one the chart's RBAC grants (the apiserver answers 403 otherwise,
and the test fails with that line); ``helm uninstall`` leaves nothing of the chart behind.

The chart's Deployment is installed as is, but its pod selects a label no process node has
(``support.chart_values``): the operator process of the test plays it, with its account.
A control test shows the 403 check bites: the same operator on an account whose role lacks
one verb logs the apiserver's 403.

Real: helm v4, kubectl, the control plane, its RBAC authorizer and garbage collector.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from tests.cluster.support import (
    OPERATOR_NAMESPACE,
    Cluster,
    OperatorProcess,
    example,
    install_chart,
    sa_kubeconfig,
    uninstall_chart,
    wait,
)

NS = "chart"
RELEASE = "chart-check"
INSTANCE = f"app.kubernetes.io/instance={RELEASE}"
#: Every kind the chart renders, namespaced ones listed in all namespaces.
CHART_KINDS = (
    "clusterroles",
    "clusterrolebindings",
    "roles",
    "rolebindings",
    "serviceaccounts",
    "deployments",
    "replicasets",
    "pods",
    "services",
    "poddisruptionbudgets",
)


def _left(cluster: Cluster) -> list[str]:
    out = cluster.kubectl.ok("get", ",".join(CHART_KINDS), "-A", "-l", INSTANCE, "-o", "name")
    return out.split()


def test_install_run_a_job_on_the_chart_rbac_then_uninstall_leaves_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    install = install_chart(cluster, RELEASE, tmp_path)
    try:
        cluster.kubectl.ok(
            "wait", "--for=condition=Established", "crd/refitjobs.refit.dev", "--timeout=60s"
        )
        whoami = json.loads(
            cluster.kubectl.ok("auth", "whoami", "-o", "json", kubeconfig=install.kubeconfig)
        )
        account = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{RELEASE}-refit-operator"
        assert whoami["status"]["userInfo"]["username"] == account
        assert _left(cluster), "helm installed nothing labelled with the release"
        cluster.namespace(NS)
        job = example("local", metadata={"name": "chart-job", "namespace": NS})
        job["spec"]["transfer"]["refits"] = 1
        cluster.kubectl.apply(job)
        cluster.kubectl.ok(
            "wait", "--for=condition=Complete", "rj/chart-job", "-n", NS, "--timeout=300s"
        )
        assert install.operator.forbidden() == [], install.operator.forbidden()
        events = cluster.kubectl.json("get", "events", "-n", NS)["items"]
        assert any(e["involvedObject"]["name"] == "chart-job" for e in events)
        cluster.kubectl.ok("delete", "rj", "chart-job", "-n", NS, "--wait=true", "--timeout=120s")
    finally:
        uninstall_chart(cluster, install)
    # The garbage collector takes the Deployment's ReplicaSet and pod after helm is done.
    wait(lambda: _left(cluster) == [], "nothing of the release left after helm uninstall", 60)
    releases = cluster.helm.run("list", "-A", "-o", "json")
    assert releases.returncode == 0 and json.loads(releases.stdout) == []
    # The CRD stays, with any RefitJobs (crds.keep: helm.sh/resource-policy: keep).
    assert cluster.rest.find(
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/refitjobs.refit.dev"
    )


def test_namespaced_install_runs_a_job_on_its_roles_alone(cluster: Cluster, tmp_path: Path) -> None:
    """``watchNamespaces``: a Role per watched namespace and only Node reads cluster-wide;
    the operator on that account reconciles a job there and meets no 403."""
    team = cluster.namespace("team-a")
    install = install_chart(cluster, "scoped", tmp_path, watch_namespaces=(team,))
    try:
        kinds = cluster.kubectl.ok(
            "get",
            "clusterroles,roles",
            "-A",
            "-l",
            "app.kubernetes.io/instance=scoped",
            "-o",
            "name",
        )
        # The operator's own: Node reads cluster-wide, the rest in team-a only; beside them
        # the leader Lease's Role (release namespace) and the users' aggregated roles.
        assert sorted(kinds.split()) == [
            "clusterrole.rbac.authorization.k8s.io/scoped-refit-operator",
            "clusterrole.rbac.authorization.k8s.io/scoped-refit-operator-refitjob-editor",
            "clusterrole.rbac.authorization.k8s.io/scoped-refit-operator-refitjob-viewer",
            "role.rbac.authorization.k8s.io/scoped-refit-operator",
            "role.rbac.authorization.k8s.io/scoped-refit-operator-leader-election",
        ]
        job = example("local", metadata={"name": "scoped-job", "namespace": team})
        job["spec"]["transfer"]["refits"] = 1
        cluster.kubectl.apply(job)
        cluster.kubectl.ok(
            "wait", "--for=condition=Complete", "rj/scoped-job", "-n", team, "--timeout=300s"
        )
        assert install.operator.forbidden() == [], install.operator.forbidden()
        denied = cluster.kubectl.run(
            "auth", "can-i", "create", "pods", "-n", "default", kubeconfig=install.kubeconfig
        )
        assert denied.stdout.strip() == "no"
        cluster.kubectl.ok(
            "delete", "rj", "scoped-job", "-n", team, "--wait=true", "--timeout=120s"
        )
    finally:
        uninstall_chart(cluster, install)


def _without(role: dict[str, Any], resource: str, verb: str) -> dict[str, Any]:
    rules = []
    for rule in role["rules"]:
        kept = dict(rule)
        if resource in kept.get("resources", []):
            kept["verbs"] = [v for v in kept["verbs"] if v != verb]
        rules.append(kept)
    return {**role, "rules": rules}


def test_a_missing_verb_shows_as_the_apiservers_403(cluster: Cluster, tmp_path: Path) -> None:
    rendered = cluster.helm.run(
        "template",
        "crippled",
        str(Path(__file__).parents[2] / "charts" / "refit-operator"),
        "--namespace",
        OPERATOR_NAMESPACE,
    )
    assert rendered.returncode == 0, rendered.stderr
    role = next(
        d
        for d in yaml.safe_load_all(rendered.stdout)
        if d and d["kind"] == "ClusterRole" and d["metadata"]["name"] == "crippled-refit-operator"
    )
    role = _without(role, "configmaps", "create")
    role["metadata"] = {"name": "crippled-operator"}
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "crippled-operator"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "crippled-operator",
        },
        "subjects": [{"kind": "ServiceAccount", "name": "crippled", "namespace": NS}],
    }
    cluster.namespace(NS)
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "crippled", "namespace": NS},
    }
    cluster.kubectl.ok(
        "apply", "--server-side", "-f", str(Path(__file__).parents[2] / "crds" / "refitjob.yaml")
    )
    cluster.kubectl.apply([account, role, binding])
    operator = OperatorProcess(
        sa_kubeconfig(cluster, "crippled", NS, tmp_path / "kubeconfig"), tmp_path / "operator.log"
    )
    operator.start()
    try:
        job = example("local", metadata={"name": "crippled-job", "namespace": NS})
        cluster.kubectl.apply(job)
        lines = wait(operator.forbidden, "the operator to meet the apiserver's 403", timeout=30)
        # The chart's rule for pods, services and configmaps, less "create".
        assert any("cannot create resource" in line for line in lines), lines
        cluster.kubectl.ok("delete", "rj", "crippled-job", "-n", NS, "--wait=true", "--timeout=60s")
    finally:
        operator.stop()
        cluster.kubectl.ok("delete", "clusterrolebinding,clusterrole", "crippled-operator")
