"""The chart's RBAC covers what the operator actually does, in both install modes.

The operator's own tables say which kinds it touches (``refit_operator.kube.PLURALS``) and
which Role it creates per job (``refit_operator.children.render_rbac``); the chart, rendered
by the real helm v4, must grant those rights, or the operator fails with 403 on a cluster.
Kubernetes refuses to let an account create a Role granting more than it holds itself, so
the per-job Role must be a subset of the operator's rights.

Real: helm, the chart, the operator's pure renderers.  Emulated: nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.binaries import ensure_tools
from tests.chart_tools import NAMESPACE, RELEASE, Helm, by_kind

from refit_operator import kube, models
from refit_operator.children import render_rbac
from refit_operator.render import JobRef

MODES = {"cluster-wide": None, "namespaced": {"watchNamespaces": ["team-a"]}}
#: What the API wrapper does with any child kind (create, delete, get, list, merge patch).
CHILD_VERBS = {"get", "list", "watch", "create", "delete"}
Grant = tuple[str, str, str, str | None]  # group, resource, verb, resourceName (None: any)


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(ensure_tools().helm, tmp_path_factory.mktemp("helm-home"))


def grants(role: dict[str, Any]) -> set[Grant]:
    out: set[Grant] = set()
    for rule in role["rules"]:
        for name in rule.get("resourceNames") or [None]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    out |= {(group, resource, verb, name) for verb in rule["verbs"]}
    return out


def allowed(held: set[Grant], wanted: Grant) -> bool:
    """Whether ``held`` covers ``wanted`` (a grant without names covers every name)."""
    group, resource, verb, _ = wanted
    return wanted in held or (group, resource, verb, None) in held


def operator_grants(objects: list[dict[str, Any]], namespace: str) -> set[Grant]:
    """What the operator's ServiceAccount may do in ``namespace``: the roles of every
    ClusterRoleBinding naming it, and of every RoleBinding there naming it."""
    account = by_kind(objects, "ServiceAccount")[0]["metadata"]["name"]
    roles = {
        (r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"]): r
        for r in (by_kind(objects, "ClusterRole") + by_kind(objects, "Role"))
    }
    held: set[Grant] = set()
    for binding in by_kind(objects, "ClusterRoleBinding") + by_kind(objects, "RoleBinding"):
        where = binding["metadata"].get("namespace")
        if where not in (None, namespace):
            continue
        if not any(s["name"] == account for s in binding["subjects"]):
            continue
        ref = binding["roleRef"]
        scope = None if ref["kind"] == "ClusterRole" else where
        held |= grants(roles[(ref["kind"], scope, ref["name"])])
    return held


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_kind_the_operator_touches_is_granted(helm: Helm, tmp_path: Path, mode: str) -> None:
    objects = helm.render(MODES[mode], tmp_path)
    held = operator_grants(objects, "team-a")
    missing = []
    for (api_version, kind), plural in kube.PLURALS.items():
        group = api_version.rpartition("/")[0]
        if kind == "Lease":
            continue  # the leader Lease is in the release's namespace: the next test
        if kind == "Event":
            verbs = {"create"}
        elif kind == models.KIND:
            # delete: the job itself once its ttlSecondsAfterFinished ran out.
            verbs = {"get", "list", "watch", "patch", "delete"}
        else:
            verbs = CHILD_VERBS
        missing += [
            f"{verb} {group or 'core'}/{plural}"
            for verb in sorted(verbs)
            if not allowed(held, (group, plural, verb, None))
        ]
    for verb in ("get", "patch"):
        if not allowed(held, (models.GROUP, f"{models.PLURAL}/status", verb, None)):
            missing.append(f"{verb} {models.GROUP}/{models.PLURAL}/status")
    # The operator merge-patches these children (rendezvous barrier, pod labels).
    for plural in ("pods", "services", "configmaps"):
        if not allowed(held, ("", plural, "patch", None)):
            missing.append(f"patch core/{plural}")
    assert missing == []


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_leader_lease_and_only_it_is_granted_in_the_release_namespace(
    helm: Helm, tmp_path: Path, mode: str
) -> None:
    objects = helm.render(MODES[mode], tmp_path)
    lease = f"{RELEASE}-refit-operator"  # the chart's --leader-election-id
    held = operator_grants(objects, NAMESPACE)
    for verb in ("get", "update", "patch", "create"):
        assert allowed(held, ("coordination.k8s.io", "leases", verb, lease)), verb
    # Only create (which cannot name its object) is granted on any Lease.
    assert not allowed(held, ("coordination.k8s.io", "leases", "update", "kube-scheduler"))
    assert ("coordination.k8s.io", "leases", "create", None) in held
    elsewhere = operator_grants(objects, "team-a")
    assert not any(g == "coordination.k8s.io" for g, _, _, _ in elsewhere)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_per_job_role_does_not_escalate(helm: Helm, tmp_path: Path, mode: str) -> None:
    held = operator_grants(helm.render(MODES[mode], tmp_path), "team-a")
    spec = models.RefitJobSpec(image="registry.example.com/ml/refit:0.1.0")
    children = render_rbac(JobRef(name="demo", namespace="team-a", uid="u-1"), spec)
    (role,) = [c for c in children if c["kind"] == "Role"]
    beyond = sorted(g for g in grants(role) if not allowed(held, g))
    assert grants(role), "render_rbac produced a Role without rules"
    assert beyond == []


def test_namespaced_mode_grants_nothing_outside_the_list(helm: Helm, tmp_path: Path) -> None:
    held = operator_grants(helm.render(MODES["namespaced"], tmp_path), "team-b")
    # Cluster-scoped kinds only (CRDs, Nodes): nothing of team-b's own objects.
    assert {(g, r) for g, r, _, _ in held} == {
        ("apiextensions.k8s.io", "customresourcedefinitions"),
        ("", "nodes"),
    }


@pytest.mark.parametrize("mode", sorted(MODES))
def test_nodes_are_granted_exactly_the_verbs_the_operator_uses(
    helm: Helm, tmp_path: Path, mode: str
) -> None:
    """Least privilege on a cluster-scoped kind: the verbs ``kube.CLUSTER_READS`` says
    the operator uses (a GET per node its pods are on), no list, no write."""
    held = operator_grants(helm.render(MODES[mode], tmp_path), "team-a")
    for (api_version, _kind), (plural, verbs) in kube.CLUSTER_READS.items():
        group = api_version.rpartition("/")[0]
        granted = {verb for g, resource, verb, _ in held if (g, resource) == (group, plural)}
        assert granted == set(verbs), plural
    assert not allowed(held, ("", "nodes", "patch", None))
    assert not allowed(held, ("", "nodes", "list", None))


def test_grant_check_notices_a_missing_right() -> None:
    # Guards the guard: a held set without patch must not cover a wanted patch.
    held: set[Grant] = {("", "configmaps", "get", None), ("", "pods", "patch", "only-this")}
    assert allowed(held, ("", "configmaps", "get", "demo-rendezvous"))
    assert not allowed(held, ("", "configmaps", "patch", "demo-rendezvous"))
    assert not allowed(held, ("", "pods", "patch", "another-pod"))
