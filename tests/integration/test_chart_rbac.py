"""The chart's RBAC is what the operator actually does, in both install modes: everything
needed, and nothing extra.

The operator's own table says which verbs it uses on which kind
(``refit_operator.shell.kube.VERBS`` beside ``PLURALS``), and which Roles it creates per job
(``refit_operator.render.children.render_rbac``); the chart, rendered by the real helm v4,
must grant exactly those rights: one missing and the operator meets a 403 on a cluster, one
more and a taken-over operator could do more than it ever does.  Kubernetes refuses to let
an account create a Role granting more than it holds itself, so the per-job Roles' rights
count as needed.  Each worker role's Role grants exactly what its pods' ConfigMap store
calls: get and watch on the job's maps, patch on its own role's.

Real: helm, the chart, the operator's pure renderers.  Emulated: nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.binaries import ensure_tools
from tests.chart_tools import NAMESPACE, RELEASE, Helm, by_kind

from refit_operator.api import models, names
from refit_operator.render.children import render_rbac
from refit_operator.render.pods import JobRef
from refit_operator.shell import kube
from refit_worker.contract.roles import ROLES, Role

MODES = {"cluster-wide": None, "namespaced": {"watchNamespaces": ["team-a"]}}
Grant = tuple[str, str, str, str | None]  # group, resource, verb, resourceName (None: any)
Right = tuple[str, str, str]  # group, resource, verb
JOB = JobRef(name="demo", namespace="team-a", uid="u-1")
SPEC = models.RefitJobSpec(image="registry.example.com/ml/refit:0.1.0")
LEASE = ("coordination.k8s.io/v1", "Lease")
#: The ConfigMap store's calls (``refit_worker.rendezvous.configmap_store``): a read of
#: a map (get), a watch of one map by name (watch), a merge patch of one key (patch).
WORKER_READS, WORKER_WRITES = frozenset({"get", "watch"}), frozenset({"patch"})


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


def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0]


def _words(rights: set[Right]) -> list[str]:
    return sorted(f"{verb} {group or 'core'}/{resource}" for group, resource, verb in rights)


def operator_needs() -> set[Right]:
    """What the operator's account must hold in a namespace it serves: the verbs it uses
    (``kube.VERBS``, the Lease aside: it lives in the release's namespace) and every right
    the per-job worker Roles hand on (Kubernetes refuses to let an account grant what it
    does not hold)."""
    needs: set[Right] = set()
    for (api_version, kind), verbs in kube.VERBS.items():
        if (api_version, kind) != LEASE:
            plural = kube.PLURALS[(api_version, kind)]
            needs |= {(_group(api_version), plural, verb) for verb in verbs}
    for (api_version, kind, sub), verbs in kube.SUBRESOURCE_VERBS.items():
        plural = f"{kube.PLURALS[(api_version, kind)]}/{sub}"
        needs |= {(_group(api_version), plural, verb) for verb in verbs}
    for role in worker_roles():
        needs |= {(group, resource, verb) for group, resource, verb, _ in grants(role)}
    return needs


def cluster_reads() -> set[Right]:
    return {
        (_group(api_version), plural, verb)
        for (api_version, _), (plural, verbs) in kube.CLUSTER_READS.items()
        for verb in verbs
    }


def worker_roles() -> list[dict[str, Any]]:
    return [c for c in render_rbac(JOB, SPEC) if c["kind"] == "Role"]


def missing(held: set[Grant], needs: set[Right]) -> list[str]:
    """Each right of ``needs`` that ``held`` does not cover."""
    return _words({r for r in needs if not allowed(held, (*r, None))})


def beyond(held: set[Grant], needs: set[Right]) -> list[str]:
    """Each right ``held`` grants that ``needs`` does not name: an extra grant."""
    return _words({(g, r, v) for g, r, v, _ in held} - needs)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_verb_the_operator_uses_is_granted(helm: Helm, tmp_path: Path, mode: str) -> None:
    held = operator_grants(helm.render(MODES[mode], tmp_path), "team-a")
    assert missing(held, operator_needs() | cluster_reads()) == []


@pytest.mark.parametrize("mode", sorted(MODES))
def test_nothing_extra_is_granted(helm: Helm, tmp_path: Path, mode: str) -> None:
    """Every right the chart gives the operator is one its code uses (``kube.VERBS``,
    ``SUBRESOURCE_VERBS``, ``CLUSTER_READS``, the leader Lease) or hands on to the
    workers: in a served namespace and in the release's own."""
    objects = helm.render(MODES[mode], tmp_path)
    needs = operator_needs() | cluster_reads()
    assert beyond(operator_grants(objects, "team-a"), needs) == []
    lease = {("coordination.k8s.io", "leases", verb) for verb in kube.VERBS[LEASE]}
    release = needs if mode == "cluster-wide" else cluster_reads()
    assert beyond(operator_grants(objects, NAMESPACE), release | lease) == []


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_leader_lease_and_only_it_is_granted_in_the_release_namespace(
    helm: Helm, tmp_path: Path, mode: str
) -> None:
    objects = helm.render(MODES[mode], tmp_path)
    lease = f"{RELEASE}-refit-operator"  # the chart's --leader-election-id
    held = operator_grants(objects, NAMESPACE)
    granted = {v for g, r, v, _ in held if (g, r) == ("coordination.k8s.io", "leases")}
    assert granted == set(kube.VERBS[LEASE])
    for verb in kube.VERBS[LEASE] - {"create"}:
        assert allowed(held, ("coordination.k8s.io", "leases", verb, lease)), verb
        # Only create (which cannot name its object) is granted on any Lease.
        assert not allowed(held, ("coordination.k8s.io", "leases", verb, "kube-scheduler"))
    assert ("coordination.k8s.io", "leases", "create", None) in held
    elsewhere = operator_grants(objects, "team-a")
    assert not any(g == "coordination.k8s.io" for g, _, _, _ in elsewhere)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_per_job_role_does_not_escalate(helm: Helm, tmp_path: Path, mode: str) -> None:
    held = operator_grants(helm.render(MODES[mode], tmp_path), "team-a")
    roles = worker_roles()
    assert len(roles) == 2  # one per role
    for role in roles:
        escalation = sorted(g for g in grants(role) if not allowed(held, g))
        assert grants(role), "render_rbac produced a Role without rules"
        assert escalation == []


def worker_needs(role: Role) -> set[Grant]:
    """What ``role``'s pods call: read and watch each of the job's rendezvous maps by
    name, patch their own role's maps, and nothing else."""
    policy, rollout = SPEC.policy.replicas, SPEC.rollout.replicas
    every = names.rendezvous_maps(JOB.name, policy, rollout)
    own = names.role_rendezvous_maps(JOB.name, role, policy, rollout)
    return {("", "configmaps", verb, name) for name in every for verb in WORKER_READS} | {
        ("", "configmaps", verb, name) for name in own for verb in WORKER_WRITES
    }


@pytest.mark.parametrize("role", ROLES)
def test_each_worker_role_grants_exactly_what_its_pods_call(role: Role) -> None:
    (found,) = [r for r in worker_roles() if r["metadata"]["labels"][names.LABEL_ROLE] == role]
    held, needs = grants(found), worker_needs(role)
    assert sorted(needs - held, key=str) == [], "missing"
    assert sorted(held - needs, key=str) == [], "extra"
    # The operator's map (barrier, notice) and the other role's are read, never written.
    other = "rollout" if role == "policy" else "policy"
    for name in (
        names.rendezvous_name(JOB.name),
        *names.role_rendezvous_maps(JOB.name, other, SPEC.policy.replicas, SPEC.rollout.replicas),
    ):
        assert ("", "configmaps", "patch", name) not in held


def test_namespaced_mode_grants_nothing_outside_the_list(helm: Helm, tmp_path: Path) -> None:
    held = operator_grants(helm.render(MODES["namespaced"], tmp_path), "team-b")
    # Cluster-scoped reads only (Nodes by name): nothing of team-b's own objects.
    assert {(g, r, v) for g, r, v, _ in held} == cluster_reads()


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
    assert missing(held, {("", "configmaps", "patch")}) == ["patch core/configmaps"]


def test_extra_check_names_an_extra_grant() -> None:
    # Guards the guard: a verb nothing uses is named, whether granted by name or not.
    held: set[Grant] = {("", "services", "patch", None), ("", "pods", "get", "p-0")}
    needs: set[Right] = {("", "pods", "get")}
    assert beyond(held, needs) == ["patch core/services"]
    assert beyond(held, operator_needs()) == ["get core/pods", "patch core/services"]
