"""Pure rendering of the children that live as long as a RefitJob: one headless Service
per role (the ranks' DNS names), the rendezvous ConfigMaps (created empty: the
operator's, then each role's), and per role a ServiceAccount, Role and RoleBinding that
may read the job's rendezvous and patch only that role's maps (docs/security.md).
"""

from __future__ import annotations

from typing import Any

from refit_operator.api import names
from refit_operator.api.models import RefitJobSpec
from refit_operator.render import signing_key
from refit_operator.render.pods import JobRef, owned, pod_account
from refit_worker.contract.roles import ROLES, Role


def _meta(job: JobRef, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": job.namespace, "labels": labels}


def render_service(job: JobRef, role: Role) -> dict[str, Any]:
    """Headless Service giving each pod of a role a DNS name, ready or not."""
    labels = {**names.job_labels(job.name), names.LABEL_ROLE: role}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, names.service_name(job.name, role), labels),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {names.LABEL_JOB: job.name, names.LABEL_ROLE: role},
            "ports": [{"name": "dist", "port": names.MASTER_PORT, "targetPort": names.MASTER_PORT}],
        },
    }
    return owned(service, job)


def render_rendezvous(job: JobRef, spec: RefitJobSpec) -> list[dict[str, Any]]:
    """The rendezvous ConfigMaps, created empty: the operator's, then each role's."""
    maps = names.rendezvous_maps(job.name, spec.policy.replicas, spec.rollout.replicas)
    labels = names.job_labels(job.name)
    return [
        owned(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": _meta(job, name, labels),
                "data": {},
            },
            job,
        )
        for name in maps
    ]


def worker_rules(job: JobRef, spec: RefitJobSpec, role: Role) -> list[dict[str, Any]]:
    """What ``role``'s pods may do: read and watch every rendezvous map of the job (the
    operator's membership and notice, the other role's metadata), patch only their own
    role's maps.  Nothing else: no other ConfigMap, no Secret, no pod."""
    policy, rollout = spec.policy.replicas, spec.rollout.replicas
    return [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": names.rendezvous_maps(job.name, policy, rollout),
            "verbs": ["get", "watch"],
        },
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": names.role_rendezvous_maps(job.name, role, policy, rollout),
            "verbs": ["patch"],
        },
    ]


def render_rbac(job: JobRef, spec: RefitJobSpec) -> list[dict[str, Any]]:
    """Per role: a Role limited to this job's rendezvous (:func:`worker_rules`), bound to
    every account that role's pods run as: the role's ServiceAccount (created here) or
    the one its template names.  Nothing for a role whose pods run as the namespace's
    default account."""
    objs: list[dict[str, Any]] = []
    for role in ROLES:
        account = pod_account(job, spec, role)
        if account:
            objs += _role_rbac(job, spec, role, account)
    return [owned(obj, job) for obj in objs]


def _role_rbac(job: JobRef, spec: RefitJobSpec, role: Role, account: str) -> list[dict[str, Any]]:
    name = names.worker_account_name(job.name, role)
    labels = {**names.job_labels(job.name), names.LABEL_ROLE: role}
    objs: list[dict[str, Any]] = []
    if account == name:
        objs.append(
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(job, name, labels)}
        )
    objs.append(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(job, name, labels),
            "rules": worker_rules(job, spec, role),
        }
    )
    objs.append(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(job, name, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": job.namespace}],
        }
    )
    return objs


def render_static(job: JobRef, spec: RefitJobSpec) -> list[dict[str, Any]]:
    """Every child except pods: these live as long as the job."""
    return [
        owned(signing_key.render_secret(job.name, job.namespace), job),
        *render_rbac(job, spec),
        *(render_service(job, role) for role in ROLES),
        *render_rendezvous(job, spec),
    ]
