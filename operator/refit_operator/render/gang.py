"""Gang admission: how all pods of an epoch reach the scheduler together, or not at all.

Three ways, chosen per job by ``spec.gang.admission``:

- ``SchedulingGates`` (the default; nothing to install): every pod is created with the
  gate ``refit.dev/gang``, which keeps kube-scheduler from placing it; once every pod of
  the epoch exists, the operator removes the gate from all of them.  The scheduler then
  sees the whole gang at once, so a gang that fits is placed together; one that does not
  fit is caught by the start deadline, which fails the epoch and frees what was placed.
- ``PodGroup``: a PodGroup with ``minMember`` = the gang, for a gang scheduler that places
  all members or none (Volcano's ``scheduling.volcano.sh/v1beta1``, or the scheduler-plugins
  coscheduling plugin's ``scheduling.x-k8s.io/v1alpha1``); the pods name the group the
  way each scheduler reads it and get its ``schedulerName``.
- ``None``: pods go to the scheduler as they are created.

Pure.
"""

from __future__ import annotations

from typing import Any

from refit_operator.api import names
from refit_operator.api.roles import GangSpec

#: The scheduling gate the operator holds a gang's pods with.
GATE = "refit.dev/gang"
VOLCANO_API = "scheduling.volcano.sh/v1beta1"
COSCHEDULING_API = "scheduling.x-k8s.io/v1alpha1"
#: Where each gang scheduler reads a pod's group: Volcano an annotation, coscheduling a label.
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
DEFAULT_SCHEDULER = {"Volcano": "volcano", "Coscheduling": "scheduler-plugins-scheduler"}
#: (apiVersion, kind) of every PodGroup kind the operator may create.
POD_GROUP_KINDS = ((VOLCANO_API, "PodGroup"), (COSCHEDULING_API, "PodGroup"))


def pod_group_name(job: str, epoch: int) -> str:
    """One PodGroup per epoch: a recreated gang is a new group."""
    return f"{job}-gang-{epoch}"


def scheduling_gates(gang: GangSpec) -> list[str]:
    return [GATE] if gang.admission == "SchedulingGates" else []


def scheduler_name(gang: GangSpec) -> str:
    """The pods' schedulerName when their template names none ('' : the default)."""
    if gang.admission != "PodGroup":
        return ""
    return gang.pod_group.scheduler_name or DEFAULT_SCHEDULER[gang.pod_group.scheduler]


def pod_labels(gang: GangSpec, group: str) -> dict[str, str]:
    if gang.admission == "PodGroup" and gang.pod_group.scheduler == "Coscheduling":
        return {COSCHEDULING_GROUP_LABEL: group}
    return {}


def pod_annotations(gang: GangSpec, group: str) -> dict[str, str]:
    if gang.admission == "PodGroup" and gang.pod_group.scheduler == "Volcano":
        return {VOLCANO_GROUP_ANNOTATION: group}
    return {}


def pod_group_api(gang: GangSpec) -> str | None:
    if gang.admission != "PodGroup":
        return None
    return VOLCANO_API if gang.pod_group.scheduler == "Volcano" else COSCHEDULING_API


def render_pod_group(
    gang: GangSpec, job: str, namespace: str, epoch: int, world: int
) -> dict[str, Any] | None:
    """The epoch's PodGroup (None unless ``admission: PodGroup``); owner set by the caller."""
    api = pod_group_api(gang)
    if api is None:
        return None
    spec: dict[str, Any] = {"minMember": world}
    settings = gang.pod_group
    if settings.scheduler == "Volcano" and settings.queue:
        spec["queue"] = settings.queue
    if settings.scheduler == "Coscheduling" and settings.schedule_timeout_seconds is not None:
        spec["scheduleTimeoutSeconds"] = settings.schedule_timeout_seconds
    return {
        "apiVersion": api,
        "kind": "PodGroup",
        "metadata": {
            "name": pod_group_name(job, epoch),
            "namespace": namespace,
            "labels": {**names.job_labels(job), names.LABEL_EPOCH: str(epoch)},
        },
        "spec": spec,
    }
