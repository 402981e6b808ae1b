"""Deterministic names and labels of a RefitJob's children.

Pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from refit_worker.contract.rendezvous import Layout, place_name, shards_needed
from refit_worker.contract.roles import Role

LABEL_JOB = "refit.dev/job"
LABEL_ROLE = "refit.dev/role"
LABEL_RANK = "refit.dev/rank"
LABEL_EPOCH = "refit.dev/epoch"
#: Rollout pods only: the replica's generation (one up per replacement).
LABEL_GENERATION = "refit.dev/generation"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
#: Pod annotation: hash of the spec the pod was rendered from (a changed spec, a new gang).
ANNOTATION_SPEC_HASH = "refit.dev/spec-hash"
MANAGER = "refit-operator"

#: The port of torch.distributed's rendezvous inside a role.
MASTER_PORT = 29500

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_LABEL_MAX = 63


def pod_name(job: str, role: Role, rank: int, incarnation: int) -> str:
    """A pod's name, unique per incarnation so that a replacement never waits for the pod
    it replaces to be gone: ``<job>-policy-<rank>-e<epoch>`` (``incarnation`` is the policy
    epoch), ``<job>-rollout-<rank>-g<generation>`` (the rollout replica's generation)."""
    suffix = f"e{incarnation}" if role == "policy" else f"g{incarnation}"
    return f"{job}-{role}-{rank}-{suffix}"


def service_name(job: str, role: Role) -> str:
    return f"{job}-{role}"


def rendezvous_name(job: str, role: Role | None = None, block: int = 0) -> str:
    """``<job>-rendezvous`` is the operator's map (the barrier, the preemption notice);
    each role's ranks are in ``<job>-rendezvous-<role>[-<block>]`` (the worker's
    rendezvous protocol owns the rule and the block size)."""
    return place_name(f"{job}-rendezvous", (role, block))


def rendezvous_shards(policy_replicas: int, rollout_replicas: int) -> int:
    return shards_needed(policy_replicas, rollout_replicas)


def rendezvous_maps(job: str, policy_replicas: int, rollout_replicas: int) -> list[str]:
    """Every rendezvous map of the job, in shard order (the operator's first)."""
    layout = _layout(policy_replicas, rollout_replicas)
    return [layout.name(f"{job}-rendezvous", s) for s in range(layout.shards)]


def role_rendezvous_maps(
    job: str, role: Role, policy_replicas: int, rollout_replicas: int
) -> list[str]:
    """The maps holding ``role``'s entries: the only ones its pods may patch."""
    layout = _layout(policy_replicas, rollout_replicas)
    return [layout.name(f"{job}-rendezvous", s) for s in layout.role_shards(role)]


def _layout(policy_replicas: int, rollout_replicas: int) -> Layout:
    shards = rendezvous_shards(policy_replicas, rollout_replicas)
    return Layout(policy_replicas, rollout_replicas, shards)


def worker_account_name(job: str, role: Role) -> str:
    """The ServiceAccount (and its Role, RoleBinding) of ``role``'s pods."""
    return f"{job}-{role}-worker"


def master_addr(job: str, role: Role, namespace: str, incarnation: int) -> str:
    """Rank 0 of a role (its pod of ``incarnation``), reached through the role's headless
    Service."""
    return f"{pod_name(job, role, 0, incarnation)}.{service_name(job, role)}.{namespace}.svc"


#: Labels of a RefitJob its pods carry too: Kueue reads the queue and priority from pods
#: (its plain-Pod integration) as well as from jobs.
PROPAGATED_LABEL_PREFIXES = ("kueue.x-k8s.io/",)


def propagated_labels(labels: Mapping[str, str]) -> dict[str, str]:
    return {k: str(v) for k, v in labels.items() if k.startswith(PROPAGATED_LABEL_PREFIXES)}


def job_labels(job: str) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_MANAGED_BY: MANAGER}


def pod_labels(job: str, role: Role, rank: int, epoch: int, generation: int = 0) -> dict[str, str]:
    """Rollout pods carry their generation too; their epoch is the one they were created
    in (informational: a rollout pod outlives a policy restart)."""
    labels = {
        **job_labels(job),
        LABEL_ROLE: role,
        LABEL_RANK: str(rank),
        LABEL_EPOCH: str(epoch),
    }
    if role == "rollout":
        labels[LABEL_GENERATION] = str(generation)
    return labels


def rollout_selector(job: str) -> str:
    """The label selector of a job's rollout pods (``status.rolloutSelector``, read by the
    scale subresource and so by an HPA)."""
    return f"{LABEL_JOB}={job},{LABEL_ROLE}=rollout"


#: Incarnations a name must leave room for: ``-e``/``-g`` and this many digits.
INCARNATION_DIGITS = 6


def name_problems(job: str, policy_replicas: int, rollout_replicas: int) -> list[str]:
    """Why the children's names would be invalid (empty when fine).

    A pod's hostname and a Service's name must be DNS-1035 labels of at most 63 characters;
    a pod's name has room for an epoch or generation of up to :data:`INCARNATION_DIGITS`
    digits.
    """
    problems: list[str] = []
    room = 10**INCARNATION_DIGITS - 1  # a name must stay valid through many restarts
    longest = max(
        pod_name(job, "policy", policy_replicas - 1, room),
        pod_name(job, "rollout", rollout_replicas - 1, room),
        key=len,
    )
    if not _DNS_LABEL.match(job):
        problems.append(
            f"job name {job!r} must be a DNS-1035 label (lowercase, starts with a letter)"
        )
    if len(longest) > _DNS_LABEL_MAX:
        problems.append(
            f"job name {job!r} is too long: pod name {longest!r} is over {_DNS_LABEL_MAX} chars"
        )
    return problems


def signing_secret_name(job: str) -> str:
    """The Secret holding the job's signing key (``signing_key``)."""
    return f"{job}-signing"
