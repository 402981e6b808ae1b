"""Pure rendering of the children that live as long as a RefitJob: one headless Service
per role (the ranks' DNS names), the rendezvous ConfigMap shards (created empty), and the
workers' ServiceAccount, Role and RoleBinding limited to this job's ConfigMaps.

Must not import: kopf, kubernetes, aiohttp.
"""

from __future__ import annotations

from typing import Any

from refit_operator import names
from refit_operator.models import RefitJobSpec
from refit_operator.render import JobRef, owned, pod_account
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
    """The rendezvous ConfigMap shards, created empty; workers write their own keys."""
    shards = names.rendezvous_shards(spec.policy.replicas, spec.rollout.replicas)
    return [
        owned(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": _meta(
                    job, names.rendezvous_name(job.name, i), names.job_labels(job.name)
                ),
                "data": {},
            },
            job,
        )
        for i in range(shards)
    ]


def render_rbac(job: JobRef, spec: RefitJobSpec) -> list[dict[str, Any]]:
    """A Role that may only read, watch and patch this job's rendezvous, bound to every
    account the pods run as: the per-job ServiceAccount (created here) and any the
    templates name.  Nothing when the pods run as the namespace's default account."""
    accounts = sorted({pod_account(job, spec, role) for role in ROLES} - {""})
    if not accounts:
        return []
    name = names.worker_account_name(job.name)
    labels = names.job_labels(job.name)
    shards = names.rendezvous_shards(spec.policy.replicas, spec.rollout.replicas)
    maps = [names.rendezvous_name(job.name, i) for i in range(shards)]
    objs: list[dict[str, Any]] = []
    if name in accounts:
        meta = _meta(job, name, labels)
        objs.append({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta})
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(job, name, labels),
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": maps,
                "verbs": ["get", "watch", "patch"],
            }
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(job, name, labels),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [
            {"kind": "ServiceAccount", "name": account, "namespace": job.namespace}
            for account in accounts
        ],
    }
    return [owned(obj, job) for obj in (*objs, role, binding)]


def render_static(job: JobRef, spec: RefitJobSpec) -> list[dict[str, Any]]:
    """Every child except pods: these live as long as the job."""
    return [
        *render_rbac(job, spec),
        *(render_service(job, role) for role in ROLES),
        *render_rendezvous(job, spec),
    ]
