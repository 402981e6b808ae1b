"""Pure rendering of a RefitJob's children: pods, headless Services, rendezvous ConfigMaps, RBAC.

Every function maps the typed spec to a plain manifest dict; :func:`owned` attaches the
controller ownerReference in one place.  Nothing here reads or writes the API.

Must not import: kopf, kubernetes, aiohttp; of the worker only ``refit_worker.contract``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from refit_operator import names
from refit_operator.models import API_VERSION, KIND, RefitJobSpec
from refit_worker.contract.config import (
    DOWNWARD_API_FIELDS,
    RendezvousConfig,
    SafetensorsWeights,
    TransferConfig,
    WeightsSource,
    WorkerConfig,
    env_name,
)
from refit_worker.contract.roles import ROLES, Role

CONTAINER = "worker"
DEFAULT_COMMAND = ("refit-worker",)
SIGNAL_COMMAND = "refit-signal"
SIGNAL_DIR = "/var/run/refit"
WEIGHTS_DIR = "/var/lib/refit/weights"
RUN_AS = 1000


@dataclass(frozen=True)
class JobRef:
    """The identity of the owning RefitJob."""

    name: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class RenderOptions:
    """Cluster facts the operator is told at start-up."""

    #: The cluster honours ``lifecycle.stopSignal`` (k8s >= 1.33, gate ContainerStopSignals).
    stop_signal_supported: bool = False


def injection_mode(spec: RefitJobSpec, options: RenderOptions) -> str:
    """``auto`` picks ``stopSignal`` where the cluster supports it, else ``preStop``.

    The stop signal reaches the container's main process straight from the kubelet and needs
    no helper in the image; the preStop hook works on every cluster.
    """
    mode = spec.preemption.injection
    if mode != "auto":
        return mode
    return "stopSignal" if options.stop_signal_supported else "preStop"


def owned(obj: dict[str, Any], job: JobRef) -> dict[str, Any]:
    """Return ``obj`` with the job as its controlling owner (for cascading delete)."""
    meta = dict(obj["metadata"])
    meta["ownerReferences"] = [
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": job.name,
            "uid": job.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    return {**obj, "metadata": meta}


def _meta(job: JobRef, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": job.namespace, "labels": labels}


def worker_config(
    job: JobRef,
    spec: RefitJobSpec,
    role: Role,
    rank: int,
    *,
    epoch: int,
    options: RenderOptions,
    first_refit: int = 0,
) -> WorkerConfig:
    """The worker's configuration for one rank (downward-API fields left empty)."""
    weights: WeightsSource
    if spec.weights.synthetic is not None:
        weights = spec.weights.synthetic
    else:
        volume = spec.weights.safetensors
        path = f"{WEIGHTS_DIR}/{volume.path}".rstrip("/") if volume else WEIGHTS_DIR
        weights = SafetensorsWeights(path=path)
    return WorkerConfig(
        job=job.name,
        namespace=job.namespace,
        role=role,
        rank=rank,
        policy_world_size=spec.policy.replicas,
        rollout_world_size=spec.rollout.replicas,
        epoch=epoch,
        first_refit=first_refit,
        master_addr=names.master_addr(job.name, role, job.namespace),
        master_port=names.MASTER_PORT,
        weights=weights,
        transfer=TransferConfig(**spec.transfer.knobs(), bucket_size=spec.transfer.bucket_bytes),
        rendezvous=RendezvousConfig(
            store="configmap",
            location=names.rendezvous_name(job.name),
            shards=names.rendezvous_shards(spec.policy.replicas, spec.rollout.replicas),
        ),
        preemption_signal=(spec.preemption.parsed_signal,),
        signal_pid_dir=SIGNAL_DIR if injection_mode(spec, options) == "preStop" else "",
    )


def worker_env(config: WorkerConfig, spec: RefitJobSpec, role: Role) -> list[dict[str, Any]]:
    """Env entries: the config's variables (downward API where the pod knows better), then
    the role's extra env."""
    downward = {env_name(field): path for field, path in DOWNWARD_API_FIELDS.items()}
    env: list[dict[str, Any]] = []
    for key, value in sorted(config.to_env().items()):
        if key in downward:
            env.append({"name": key, "valueFrom": {"fieldRef": {"fieldPath": downward[key]}}})
        else:
            env.append({"name": key, "value": value})
    role_spec = spec.policy if role == "policy" else spec.rollout
    env.extend({"name": e.name, "value": e.value} for e in role_spec.env)
    return env


def spec_hash(spec: RefitJobSpec) -> str:
    """A short digest of what shapes the pods (not failurePolicy or suspend)."""
    shape = spec.model_dump(mode="json", exclude={"failure_policy", "suspend"})
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def _stop_grace(grace: int) -> int:
    # The preStop hook shares the grace period with the kubelet's own stop; leave it a quarter.
    return max(1, grace - grace // 4)


def render_pod(
    job: JobRef,
    spec: RefitJobSpec,
    role: Role,
    rank: int,
    *,
    epoch: int,
    options: RenderOptions,
    first_refit: int = 0,
) -> dict[str, Any]:
    """One rank's pod: never restarted in place (the gang restarts instead)."""
    role_spec = spec.policy if role == "policy" else spec.rollout
    config = worker_config(
        job, spec, role, rank, epoch=epoch, options=options, first_refit=first_refit
    )
    mode = injection_mode(spec, options)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(role_spec.command or DEFAULT_COMMAND),
        "env": worker_env(config, spec, role),
        "ports": [{"name": "dist", "containerPort": names.MASTER_PORT, "protocol": "TCP"}],
        "resources": role_spec.resources.model_dump(exclude_defaults=True),
        # The worker writes why it failed there; any other command's failure still gets
        # the end of its log into the pod's (and so the job's) status.
        "terminationMessagePath": config.termination_message_path,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
        },
    }
    if role_spec.args:
        container["args"] = list(role_spec.args)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "hostname": names.pod_name(job.name, role, rank),
        "subdomain": names.service_name(job.name, role),
        "terminationGracePeriodSeconds": spec.preemption.grace_period_seconds,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
    }
    account = role_spec.service_account_name or (
        names.worker_account_name(job.name) if spec.create_service_account else ""
    )
    if account:
        pod_spec["serviceAccountName"] = account
    for key, value in (
        ("nodeSelector", role_spec.node_selector),
        ("tolerations", role_spec.tolerations),
        ("affinity", role_spec.affinity),
    ):
        if value:
            pod_spec[key] = value
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if mode == "stopSignal":
        container["lifecycle"] = {"stopSignal": spec.preemption.signal_name}
        pod_spec["os"] = {"name": "linux"}  # the API accepts stopSignal only with an OS set
    else:
        timeout = str(_stop_grace(spec.preemption.grace_period_seconds))
        container["lifecycle"] = {
            "preStop": {"exec": {"command": [SIGNAL_COMMAND, "--timeout", timeout]}}
        }
        volumes.append({"name": "refit-signal", "emptyDir": {}})
        mounts.append({"name": "refit-signal", "mountPath": SIGNAL_DIR})
    if spec.weights.safetensors is not None:
        volumes.append(
            {
                "name": "weights",
                "persistentVolumeClaim": {
                    "claimName": spec.weights.safetensors.claim_name,
                    "readOnly": True,
                },
            }
        )
        mounts.append({"name": "weights", "mountPath": WEIGHTS_DIR, "readOnly": True})
    if volumes:
        pod_spec["volumes"] = volumes
        container["volumeMounts"] = mounts
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            **_meta(
                job,
                names.pod_name(job.name, role, rank),
                names.pod_labels(job.name, role, rank, epoch),
            ),
            "annotations": {names.ANNOTATION_SPEC_HASH: spec_hash(spec)},
        },
        "spec": pod_spec,
    }
    return owned(pod, job)


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
    """A ServiceAccount whose Role may only read, watch and patch this job's rendezvous."""
    if not spec.create_service_account:
        return []
    name = names.worker_account_name(job.name)
    labels = names.job_labels(job.name)
    shards = names.rendezvous_shards(spec.policy.replicas, spec.rollout.replicas)
    maps = [names.rendezvous_name(job.name, i) for i in range(shards)]
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(job, name, labels)}
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
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.namespace}],
    }
    return [owned(obj, job) for obj in (account, role, binding)]


def render_static(job: JobRef, spec: RefitJobSpec) -> list[dict[str, Any]]:
    """Every child except pods: these live as long as the job."""
    return [
        *render_rbac(job, spec),
        *(render_service(job, role) for role in ROLES),
        *render_rendezvous(job, spec),
    ]


def render_gang(
    job: JobRef, spec: RefitJobSpec, epoch: int, options: RenderOptions, first_refit: int = 0
) -> list[dict[str, Any]]:
    """All pods of one epoch; ``first_refit``: refits done before (a recreated gang resumes)."""
    return [
        render_pod(job, spec, role, rank, epoch=epoch, options=options, first_refit=first_refit)
        for role in ROLES
        for rank in range(spec.policy.replicas if role == "policy" else spec.rollout.replicas)
    ]
