"""Pure builders for what a process node writes to the API: its ``Node`` object, its
heartbeat ``Lease``, a pod's status, a token request and a pod's kubeconfig.

The shapes follow what a kubelet writes (conditions by type, ``containerStatuses`` with
state and exit code, RFC 3339 timestamps); the addresses are loopback, because every
process node of the tests lives on this one host.

Must not import: kubernetes, the operator's API shell (pure dicts in, dicts out).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

LOOPBACK = "127.0.0.1"
#: What ``kubectl get nodes`` shows as the version: honest about what runs the pods.
NODE_AGENT = "kube-refit-process-node"
LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40
#: The projected volume the ServiceAccount admission plugin adds to a pod with a token.
TOKEN_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_TOKEN_SECONDS = 3607


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_object(
    name: str,
    *,
    capacity: Mapping[str, str],
    labels: Mapping[str, str],
    taints: list[dict[str, str]],
) -> dict[str, Any]:
    """The ``Node`` a process node registers (status is written separately)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                **labels,
            },
        },
        "spec": {"taints": list(taints)} if taints else {},
    }


def node_status(name: str, capacity: Mapping[str, str], started: str) -> dict[str, Any]:
    """Capacity, a Ready condition with a fresh heartbeat, addresses, agent info."""
    stamp = now()

    def condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": stamp,
            "lastTransitionTime": started,
        }

    return {
        "capacity": dict(capacity),
        "allocatable": dict(capacity),
        "conditions": [
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "no pressure"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "no pressure"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID", "no pressure"),
            condition("Ready", "True", "KubeletReady", "process node is posting ready status"),
        ],
        "addresses": [
            {"type": "InternalIP", "address": LOOPBACK},
            {"type": "Hostname", "address": name},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
        "nodeInfo": {
            "machineID": name,
            "systemUUID": name,
            "bootID": started,
            "kernelVersion": "",
            "osImage": "process node (kube-refit tests)",
            "containerRuntimeVersion": "process://",
            "kubeletVersion": NODE_AGENT,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
    }


def lease_object(node: Mapping[str, Any]) -> dict[str, Any]:
    """The node's heartbeat Lease in ``kube-node-lease``, owned by the Node."""
    name = node["metadata"]["name"]
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "namespace": LEASE_NAMESPACE,
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": name,
                    "uid": node["metadata"]["uid"],
                }
            ],
        },
        "spec": {
            "holderIdentity": name,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": micro_now(),
        },
    }


def pod_status(pod: Mapping[str, Any], local: Mapping[str, Any] | None) -> dict[str, Any]:
    """The status a kubelet reports for ``pod`` whose process the kubelet reports as
    ``local`` (the :class:`~refit_operator.local.kubelet.ProcessKubelet` view)."""
    container = pod["spec"]["containers"][0]
    if local is None:
        raise ValueError(f"pod {pod['metadata']['name']}: no local status to report")
    ours = local["status"]
    state = ours["containerStatuses"][0]["state"]
    running = "running" in state
    started = ours.get("startTime") or now()
    ready = "True" if running else "False"
    terminated_reason = "PodCompleted" if ours["phase"] == "Succeeded" else "PodFailed"
    conditions = [
        {"type": "PodReadyToStartContainers", "status": ready},
        {"type": "Initialized", "status": "True"},
        {"type": "Ready", "status": ready},
        {"type": "ContainersReady", "status": ready},
        {"type": "PodScheduled", "status": "True"},
    ]
    for condition in conditions:
        condition["lastTransitionTime"] = started
        if condition["status"] == "False" and condition["type"] != "PodReadyToStartContainers":
            condition["reason"] = terminated_reason
    return {
        "phase": ours["phase"],
        "hostIP": LOOPBACK,
        "hostIPs": [{"ip": LOOPBACK}],
        "podIP": LOOPBACK,
        "podIPs": [{"ip": LOOPBACK}],
        "startTime": started,
        "conditions": conditions,
        "containerStatuses": [
            {
                "name": container.get("name", "main"),
                "image": container.get("image") or "process",
                "imageID": "",
                "containerID": f"process://{pod['metadata']['uid']}",
                "ready": running,
                "started": running,
                "restartCount": 0,
                "state": state,
            }
        ],
    }


def start_error_status(pod: Mapping[str, Any], message: str) -> dict[str, Any]:
    """A pod the node cannot run (no command, an unsupported volume or env source)."""
    container = pod["spec"]["containers"][0]
    stamp = now()
    return {
        "phase": "Failed",
        "reason": "StartError",
        "message": message,
        "hostIP": LOOPBACK,
        "startTime": stamp,
        "conditions": [
            {
                "type": "Ready",
                "status": "False",
                "reason": "StartError",
                "lastTransitionTime": stamp,
            }
        ],
        "containerStatuses": [
            {
                "name": container.get("name", "main"),
                "image": container.get("image") or "process",
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {
                    "terminated": {
                        "exitCode": 128,
                        "reason": "StartError",
                        "message": message,
                        "finishedAt": stamp,
                    }
                },
            }
        ],
    }


#: Registry hosts under this top-level domain never resolve (RFC 2606): a process node
#: reports their images unpullable.
UNPULLABLE_TLD = ".invalid"


def unpullable_image(pod: Mapping[str, Any]) -> str | None:
    """The first image of ``pod`` whose registry host ends in ``.invalid``, if any."""
    for container in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]:
        image = str(container.get("image") or "")
        host = image.split("/", 1)[0] if "/" in image else ""
        if host.split(":", 1)[0].endswith(UNPULLABLE_TLD):
            return image
    return None


def image_pull_status(pod: Mapping[str, Any], image: str, reason: str) -> dict[str, Any]:
    """A Pending pod whose image cannot be pulled (``ErrImagePull``, ``ImagePullBackOff``),
    with a kubelet's wording."""
    container = pod["spec"]["containers"][0]
    host = image.split("/", 1)[0]
    cause = f"dial tcp: lookup {host}: no such host"
    message = (
        f"failed to pull and unpack image {image!r}: {cause}"
        if reason == "ErrImagePull"
        else f'Back-off pulling image "{image}": ErrImagePull: {cause}'
    )
    stamp = now()
    return {
        "phase": "Pending",
        "hostIP": LOOPBACK,
        "startTime": stamp,
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp},
            {
                "type": "Ready",
                "status": "False",
                "reason": "ContainersNotReady",
                "message": f"containers with unready status: [{container.get('name')}]",
                "lastTransitionTime": stamp,
            },
        ],
        "containerStatuses": [
            {
                "name": container.get("name", "main"),
                "image": image,
                "imageID": "",
                "ready": False,
                "started": False,
                "restartCount": 0,
                "state": {"waiting": {"reason": reason, "message": message}},
            }
        ],
    }


def token_source(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``serviceAccountToken`` projection mounted at the standard path, if any.

    The ServiceAccount admission plugin adds it (``kube-api-access-*``) unless the pod or
    its account sets ``automountServiceAccountToken: false``.
    """
    container = pod["spec"]["containers"][0]
    mounted = {
        m["name"] for m in container.get("volumeMounts") or [] if m["mountPath"] == TOKEN_MOUNT
    }
    for volume in pod["spec"].get("volumes") or []:
        if volume["name"] not in mounted:
            continue
        for source in (volume.get("projected") or {}).get("sources") or []:
            if "serviceAccountToken" in source:
                return dict(source["serviceAccountToken"])
    return None


def token_request(pod: Mapping[str, Any], source: Mapping[str, Any]) -> dict[str, Any]:
    """A TokenRequest bound to the pod, as a kubelet makes for a projected token."""
    audiences = [source["audience"]] if source.get("audience") else []
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "audiences": audiences,
            "expirationSeconds": int(source.get("expirationSeconds") or DEFAULT_TOKEN_SECONDS),
            "boundObjectRef": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod["metadata"]["name"],
                "uid": pod["metadata"]["uid"],
            },
        },
    }
