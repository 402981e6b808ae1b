"""Upgrading a running install, and who may use RefitJobs, on the real control plane.

- ``helm upgrade`` from the released 0.1.0 chart (``tests/data/charts``: CRD under
  ``crds/``, one replica, no leader election) to the working tree's chart: the new CRD
  schema is applied (a status field the old schema pruned is kept afterwards), the
  RefitJobs survive, and a job that still carries 0.1.0's finalizer loses it once the new
  operator meets it, so deleting it no longer waits for an operator.
- The chart's refitjob-editor/-viewer roles, aggregated by kube-controller-manager into
  the built-in ``edit``/``view`` roles: a user bound to ``edit`` in a namespace may create
  RefitJobs there (``kubectl auth can-i``, then a real create), and nowhere else; one
  bound to ``view`` may only read them.

Real: helm v4, kubectl (``--as`` impersonation, evaluated by the apiserver's RBAC
authorizer), kube-apiserver's structural pruning, kube-controller-manager's clusterrole
aggregation.  The operator runs as a process on the release's account, as elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.binaries import REPO_ROOT
from tests.chart_tools import CHART
from tests.cluster.support import (
    OPERATOR_NAMESPACE,
    Cluster,
    OperatorProcess,
    chart_values,
    example,
    sa_kubeconfig,
    wait,
)

OLD_CHART = REPO_ROOT / "tests" / "data" / "charts" / "refit-operator-0.1.0.tgz"
RELEASE = "upgraded"
NS = "upgrade"
CRD = "crd/refitjobs.refit.dev"
OLD_FINALIZER = "refit.dev/finalizer"


def _status_properties(cluster: Cluster) -> set[str]:
    crd = cluster.kubectl.json("get", CRD)
    (version,) = crd["spec"]["versions"]
    return set(version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"])


def _set_verification(cluster: Cluster, job: str) -> dict[str, Any]:
    """Write ``status.verification`` as an operator would; the object as stored."""
    out = cluster.kubectl.ok(
        "patch",
        "rj",
        job,
        "-n",
        NS,
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status": {"verification": "bit-exact"}}',
        "-o",
        "json",
    )
    return dict(json.loads(out).get("status") or {})


def _helm(cluster: Cluster, *args: str) -> str:
    done = cluster.helm.run(*args)
    if done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args[:2])} failed:\n{done.stderr}{done.stdout}")
    return done.stdout


def test_helm_upgrade_from_0_1_0_applies_the_new_crd_and_frees_old_jobs(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Start from a cluster that never saw this chart's CRD (earlier modules installed it).
    cluster.kubectl.ok("delete", CRD, "--ignore-not-found", "--wait=true", "--timeout=60s")
    values = str(chart_values(tmp_path / "values.yaml"))
    common = ["--namespace", OPERATOR_NAMESPACE, "--values", values, "--wait=false"]
    _helm(cluster, "install", RELEASE, str(OLD_CHART), "--create-namespace", *common)
    try:
        cluster.kubectl.ok("wait", "--for=condition=Established", CRD, "--timeout=60s")
        assert "verification" not in _status_properties(cluster)
        cluster.namespace(NS)
        job = example("local", metadata={"name": "old-job", "namespace": NS})
        job["spec"]["suspend"] = True
        # A job as 0.1.0 knew them: example() leaves out weights.synthetic.pace, which
        # 0.1.0's schema does not have (strict decoding would refuse it).
        assert "pace" not in job["spec"]["weights"]["synthetic"]
        # As 0.1.0's operator left every job it handled: with its finalizer.
        job["metadata"]["finalizers"] = [OLD_FINALIZER]
        cluster.kubectl.apply(job)
        assert "verification" not in _set_verification(cluster, "old-job")  # pruned

        # A CRD that helm installed from crds/ belongs to no release: the upgrade takes
        # ownership of it (docs/cluster.md says so), then manages and upgrades it.
        _helm(cluster, "upgrade", RELEASE, str(CHART), "--take-ownership", *common)
        wait(
            lambda: "verification" in _status_properties(cluster),
            "the upgraded CRD schema to be served",
            timeout=60,
        )
        crd = cluster.kubectl.json("get", CRD)
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == RELEASE
        assert wait(
            lambda: _set_verification(cluster, "old-job").get("verification") == "bit-exact",
            "status.verification to be kept by the new schema",
            timeout=30,
        )
        deployment = cluster.kubectl.json(
            "get", "deployment", f"{RELEASE}-refit-operator", "-n", OPERATOR_NAMESPACE
        )
        assert deployment["spec"]["replicas"] == 2
        assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
        assert (
            cluster.kubectl.json(
                "get", "pdb", f"{RELEASE}-refit-operator", "-n", OPERATOR_NAMESPACE
            )["spec"]["minAvailable"]
            == 1
        )

        # The new operator meets the old job and drops the finalizer nothing needs now.
        account = f"{RELEASE}-refit-operator"
        operator = OperatorProcess(
            sa_kubeconfig(cluster, account, OPERATOR_NAMESPACE, tmp_path / "kubeconfig"),
            tmp_path / "operator.log",
        )
        operator.start()
        try:
            wait(
                lambda: (
                    not cluster.kubectl.json("get", "rj", "old-job", "-n", NS)["metadata"].get(
                        "finalizers"
                    )
                ),
                "the new operator to remove 0.1.0's finalizer",
                timeout=60,
            )
            assert operator.forbidden() == []
        finally:
            operator.stop()
        # No operator runs now, and the delete still completes.
        cluster.kubectl.ok("delete", "rj", "old-job", "-n", NS, "--wait=true", "--timeout=30s")
    finally:
        _helm(cluster, "uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE)
    # Kept on uninstall, with the new schema.
    assert "verification" in _status_properties(cluster)


def _bind(cluster: Cluster, namespace: str, user: str, role: str) -> None:
    cluster.kubectl.apply(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": f"{user}-{role}", "namespace": namespace},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": role,
            },
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
        }
    )


def _can(cluster: Cluster, user: str, verb: str, namespace: str) -> bool:
    done = cluster.kubectl.run(
        "auth", "can-i", verb, "refitjobs.refit.dev", "-n", namespace, "--as", user
    )
    return done.stdout.strip() == "yes"


def test_users_bound_to_edit_or_view_get_refitjob_rights_there(
    cluster: Cluster, tmp_path: Path
) -> None:
    values = str(chart_values(tmp_path / "values.yaml"))
    _helm(
        cluster,
        "install",
        "roles",
        str(CHART),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--values",
        values,
        "--wait=false",
        "--take-ownership",
    )
    try:
        team, other = cluster.namespace("team-edit"), cluster.namespace("team-other")
        _bind(cluster, team, "alice", "edit")
        _bind(cluster, team, "bob", "view")
        # The aggregation controller copies the chart's rules into edit and view.
        wait(lambda: _can(cluster, "alice", "create", team), "alice may create RefitJobs", 60)
        assert not _can(cluster, "alice", "create", other)
        assert _can(cluster, "bob", "list", team) and _can(cluster, "bob", "get", team)
        assert not _can(cluster, "bob", "create", team)
        job = example("local", metadata={"name": "alices-job", "namespace": team})
        job["spec"]["suspend"] = True
        cluster.kubectl.apply(job, "--as", "alice")
        refused = cluster.kubectl.run(
            "delete", "rj", "alices-job", "-n", team, "--as", "bob", "--wait=false"
        )
        assert refused.returncode != 0 and "forbidden" in refused.stderr.lower()
        listed = cluster.kubectl.ok("get", "rj", "-n", team, "--as", "bob", "-o", "name")
        assert listed.split() == ["refitjob.refit.dev/alices-job"]
        cluster.kubectl.ok("delete", "rj", "alices-job", "-n", team, "--as", "alice")
    finally:
        _helm(cluster, "uninstall", "roles", "--namespace", OPERATOR_NAMESPACE)
