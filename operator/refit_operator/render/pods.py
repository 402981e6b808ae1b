"""Pure rendering of a RefitJob's pods: each rank's worker config and env, the spec hash,
how the preemption signal reaches the pod, the merge into the role's template (and the
conflicts it finds), the gang of an epoch.  The children that live as long as the job
(Services, rendezvous ConfigMaps, RBAC) are ``children.py``'s.

Every function maps the typed spec to a plain manifest dict; :func:`owned` attaches the
controller ownerReference in one place.  Nothing here reads or writes the API.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from refit_operator.api import names
from refit_operator.api.models import API_VERSION, KIND, RefitJobSpec
from refit_operator.render import gang
from refit_operator.render.merge import WORKER, PodParts, TemplateConflict, WorkerParts, merge_pod
from refit_worker.contract.config import (
    DOWNWARD_API_FIELDS,
    KEY_FIELDS,
    RendezvousConfig,
    SafetensorsWeights,
    TransferConfig,
    WeightsSource,
    WorkerConfig,
    env_name,
)
from refit_worker.contract.env import METRICS_PORT_ENV
from refit_worker.contract.roles import ROLES, Role

CONTAINER = WORKER
DEFAULT_COMMAND = ("refit-worker",)
SIGNAL_COMMAND = "refit-signal"
SIGNAL_DIR = "/var/run/refit"
SIGNAL_VOLUME = "refit-signal"
WEIGHTS_VOLUME = "weights"
WEIGHTS_DIR = "/var/lib/refit/weights"
#: The root filesystem is read-only; what a worker (or a library under it: torch's and
#: UCX's scratch files) writes goes to this emptyDir, which is also the image's WORKDIR.
TMP_VOLUME = "tmp"
TMP_DIR = "/tmp"
RUN_AS = 1000


@dataclass(frozen=True)
class JobRef:
    """The identity of the owning RefitJob."""

    name: str
    namespace: str
    uid: str
    #: The job's labels its pods carry too (Kueue's queue name and priority class).
    pod_labels: Mapping[str, str] = field(default_factory=dict, hash=False)


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


def worker_config(
    job: JobRef,
    spec: RefitJobSpec,
    role: Role,
    rank: int,
    *,
    epoch: int,
    options: RenderOptions,
    first_refit: int = 0,
    generation: int = 0,
    leader: int | None = None,
) -> WorkerConfig:
    """The worker's configuration for one rank (downward-API fields left empty).

    ``generation``: a rollout replica's (0 for policy ranks); ``leader``: the incarnation of
    the role's rank 0, its MASTER_ADDR (the epoch for policy ranks, rollout rank 0's
    generation for rollout ranks; default: the rank's own).
    """
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
        generation=generation if role == "rollout" else 0,
        first_refit=first_refit,
        master_addr=names.master_addr(
            job.name, role, job.namespace, _leader(role, epoch, generation, leader)
        ),
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
        hand_over_seconds=_hand_over(role, spec.preemption.grace_period_seconds),
    )


def _hand_over(role: Role, grace: int) -> float:
    # A drained rollout pod offers its weights to its replacement for half its grace
    # period: the stop (the preStop hook's wait is three quarters of it) still fits.
    return grace / 2 if role == "rollout" else 0.0


def _leader(role: Role, epoch: int, generation: int, leader: int | None) -> int:
    if role == "policy":
        return epoch
    return generation if leader is None else leader


def signing_env(job: str, role: Role) -> list[dict[str, Any]]:
    """A role's half of the job's key, read by the kubelet from the job's Secret: the
    private half for policy pods, the public half for rollout pods (never both)."""
    field = "signing_key" if role == "policy" else "verify_key"
    ref = {"name": names.signing_secret_name(job), "key": KEY_FIELDS[field]}
    return [{"name": env_name(field), "valueFrom": {"secretKeyRef": ref}}]


def worker_env(config: WorkerConfig) -> list[dict[str, Any]]:
    """The config's env entries (downward API where the pod knows better)."""
    downward = {env_name(field): path for field, path in DOWNWARD_API_FIELDS.items()}
    env: list[dict[str, Any]] = []
    for key, value in sorted(config.to_env().items()):
        if key in downward:
            env.append({"name": key, "valueFrom": {"fieldRef": {"fieldPath": downward[key]}}})
        else:
            env.append({"name": key, "value": value})
    return env


#: Spec fields that do not shape the pods: changing them never recreates a gang.  The
#: rollout replica count is among them: scaling adds or removes replicas, each joining or
#: leaving at a refit boundary (the scale subresource, an HPA), and is no spec change.
_NOT_SHAPING: dict[str, Any] = {
    "failure_policy": True,
    "suspend": True,
    "ttl_seconds_after_finished": True,
    "active_deadline_seconds": True,
    "start_deadline_seconds": True,
    "managed_by": True,
    "rollout": {"replicas": True, "failure_policy": True},
}


def spec_hash(spec: RefitJobSpec) -> str:
    """A short digest of what shapes the pods (not failurePolicy, suspend, deadlines or
    rollout.replicas)."""
    # Unset optional fields are left out, so a field added in a later version of the
    # operator does not change the digest of a running job (and recreate its gang).
    shape = spec.model_dump(mode="json", exclude=_NOT_SHAPING, exclude_none=True)
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def _stop_grace(grace: int) -> int:
    # The preStop hook shares the grace period with the kubelet's own stop; leave it a quarter.
    return max(1, grace - grace // 4)


def _worker_parts(
    job: JobRef, spec: RefitJobSpec, role: Role, config: WorkerConfig, mode: str
) -> WorkerParts:
    role_spec = spec.policy if role == "policy" else spec.rollout
    mounts: list[dict[str, Any]] = [{"name": TMP_VOLUME, "mountPath": TMP_DIR}]
    if mode == "stopSignal":
        lifecycle: dict[str, Any] = {"stopSignal": spec.preemption.signal_name}
    else:
        timeout = str(_stop_grace(spec.preemption.grace_period_seconds))
        lifecycle = {"preStop": {"exec": {"command": [SIGNAL_COMMAND, "--timeout", timeout]}}}
        mounts.append({"name": SIGNAL_VOLUME, "mountPath": SIGNAL_DIR})
    if spec.weights.safetensors is not None:
        mounts.append({"name": WEIGHTS_VOLUME, "mountPath": WEIGHTS_DIR, "readOnly": True})
    return WorkerParts(
        image=spec.image,
        image_pull_policy=spec.image_pull_policy,
        default_command=list(DEFAULT_COMMAND),
        command=list(role_spec.command),
        args=list(role_spec.args),
        env=worker_env(config) + signing_env(job.name, role) + _metrics_env(spec),
        extra_env=[{"name": e.name, "value": e.value} for e in role_spec.env],
        resources=role_spec.resources.model_dump(exclude_defaults=True),
        ports=[
            {"name": "dist", "containerPort": names.MASTER_PORT, "protocol": "TCP"},
            *_metrics_port(spec),
        ],
        lifecycle=lifecycle,
        # The worker writes why it failed there; any other command's failure still gets
        # the end of its log into the pod's (and so the job's) status.
        termination_message_path=config.termination_message_path,
        termination_message_policy="FallbackToLogsOnError",
        volume_mounts=mounts,
        security_context={
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
        },
    )


def _metrics_env(spec: RefitJobSpec) -> list[dict[str, Any]]:
    if spec.metrics is None:
        return []
    return [{"name": METRICS_PORT_ENV, "value": str(spec.metrics.port)}]


def _metrics_port(spec: RefitJobSpec) -> list[dict[str, Any]]:
    if spec.metrics is None:
        return []
    return [{"name": "metrics", "containerPort": spec.metrics.port, "protocol": "TCP"}]


def pod_account(job: JobRef, spec: RefitJobSpec, role: Role) -> str:
    """The ServiceAccount a role's pods run as ('' : the namespace's default)."""
    template = (spec.policy if role == "policy" else spec.rollout).template or {}
    named = str((template.get("spec") or {}).get("serviceAccountName") or "")
    if named:
        return named
    return names.worker_account_name(job.name, role) if spec.create_service_account else ""


def render_pod(
    job: JobRef,
    spec: RefitJobSpec,
    role: Role,
    rank: int,
    *,
    epoch: int,
    options: RenderOptions,
    first_refit: int = 0,
    generation: int = 0,
    leader: int | None = None,
) -> dict[str, Any]:
    """One rank's pod: the role's template with the operator's parts merged in (never
    restarted in place: a new incarnation under a new name replaces it).  Raises
    ``TemplateConflict``.  ``generation`` and ``leader``: as :func:`worker_config`."""
    role_spec = spec.policy if role == "policy" else spec.rollout
    config = worker_config(
        job,
        spec,
        role,
        rank,
        epoch=epoch,
        options=options,
        first_refit=first_refit,
        generation=generation,
        leader=leader,
    )
    mode = injection_mode(spec, options)
    volumes: list[dict[str, Any]] = [{"name": TMP_VOLUME, "emptyDir": {}}]
    if mode != "stopSignal":
        volumes.append({"name": SIGNAL_VOLUME, "emptyDir": {}})
    if spec.weights.safetensors is not None:
        claim = {"claimName": spec.weights.safetensors.claim_name, "readOnly": True}
        volumes.append({"name": WEIGHTS_VOLUME, "persistentVolumeClaim": claim})
    name = names.pod_name(job.name, role, rank, epoch if role == "policy" else generation)
    parts = PodParts(
        metadata=_pod_metadata(job, spec, name, role, rank, epoch=epoch, generation=generation),
        worker=_worker_parts(job, spec, role, config, mode),
        hostname=name,
        subdomain=names.service_name(job.name, role),
        grace_seconds=spec.preemption.grace_period_seconds,
        service_account=pod_account(job, spec, role),
        # The API accepts lifecycle.stopSignal only with an OS set.
        os_name="linux" if mode == "stopSignal" else None,
        scheduling_gates=gang.scheduling_gates(spec.gang),
        scheduler_name=gang.scheduler_name(spec.gang),
        volumes=volumes,
        security_context={
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    )
    return owned(merge_pod(role_spec.template, parts, f"spec.{role}.template"), job)


def _pod_metadata(
    job: JobRef,
    spec: RefitJobSpec,
    name: str,
    role: Role,
    rank: int,
    *,
    epoch: int,
    generation: int,
) -> dict[str, Any]:
    group = gang.pod_group_name(job.name, epoch)
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": {
            **job.pod_labels,
            **names.pod_labels(job.name, role, rank, epoch, generation),
            **gang.pod_labels(spec.gang, group),
        },
        "annotations": {
            names.ANNOTATION_SPEC_HASH: spec_hash(spec),
            **gang.pod_annotations(spec.gang, group),
        },
    }


def template_conflicts(job: JobRef, spec: RefitJobSpec, options: RenderOptions) -> list[str]:
    """What each role's template sets against the operator (empty: nothing)."""
    problems: list[str] = []
    for role in ROLES:
        try:
            render_pod(job, spec, role, 0, epoch=0, options=options)
        except TemplateConflict as exc:
            problems += exc.problems
    return problems


def render_gang(
    job: JobRef,
    spec: RefitJobSpec,
    epoch: int,
    options: RenderOptions,
    first_refit: int = 0,
    *,
    policy: bool = True,
    rollout: Mapping[int, int] | None = None,
    rollout_leader: int | None = None,
) -> list[dict[str, Any]]:
    """The pods created together: the policy gang of ``epoch`` (unless ``policy`` is
    False) and a pod per rollout rank of ``rollout`` (rank -> generation; default: every
    rank at generation 0), with their PodGroup if the gang is admitted by one;
    ``first_refit``: refits done before (a recreated gang resumes); ``rollout_leader``:
    rollout rank 0's generation (its MASTER_ADDR; default: as in ``rollout``)."""
    slots = dict.fromkeys(range(spec.rollout.replicas), 0) if rollout is None else rollout
    leader = slots.get(0, 0) if rollout_leader is None else rollout_leader
    pods = [
        render_pod(job, spec, "policy", rank, epoch=epoch, options=options, first_refit=first_refit)
        for rank in (range(spec.policy.replicas) if policy else ())
    ] + [
        render_pod(
            job,
            spec,
            "rollout",
            rank,
            epoch=epoch,
            options=options,
            first_refit=first_refit,
            generation=generation,
            leader=leader,
        )
        for rank, generation in sorted(slots.items())
    ]
    # The epoch's PodGroup comes with its policy gang; a rollout pod created later (a
    # replacement, a scale-up) joins the epoch's group, already admitted.
    group = gang.render_pod_group(spec.gang, job.name, job.namespace, epoch, len(pods))
    return [owned(group, job), *pods] if group is not None and policy else pods
