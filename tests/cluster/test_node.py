"""The control plane answers as Kubernetes, and the process nodes behave as kubelets: the
scheduler binds a pod, the node runs it, reports status and exit code, fills the downward
API, and stops a deleted pod with its preStop hook and stop signal within the grace period
before deleting it for good.

Real: the control plane, kubectl, kube-scheduler's placement, the node's processes.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

from tests.cluster.support import Cluster, wait

NS = "node-tests"


def _pod(name: str, code: str, **extra: Any) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": "none",
        "command": [sys.executable, "-c", code],
        "env": [
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        ],
    }
    container.update(extra.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"restartPolicy": "Never", "containers": [container], **extra},
    }


def test_server_version_parses_and_nodes_are_ready(cluster: Cluster) -> None:
    version = cluster.kubectl.json("version")
    assert version["serverVersion"]["gitVersion"] == "v1.36.3", version
    assert version["serverVersion"]["minor"] == "36"
    nodes = cluster.kubectl.json("get", "nodes")["items"]
    ready = {
        n["metadata"]["name"]: next(
            c["status"] for c in n["status"]["conditions"] if c["type"] == "Ready"
        )
        for n in nodes
    }
    assert ready == {"node-a": "True", "node-b": "True"}
    assert all(n["status"]["capacity"]["nvidia.com/gpu"] == "8" for n in nodes)


def test_scheduled_pod_runs_reports_exit_code_and_downward_api(cluster: Cluster) -> None:
    cluster.namespace(NS)
    name = f"exit-{uuid.uuid4().hex[:6]}"
    code = "import os, sys; print(os.environ['NODE'], os.environ['UID']); sys.exit(3)"
    cluster.kubectl.apply(_pod(name, code))
    pod = wait(
        lambda: (
            (p := cluster.rest.find(f"/api/v1/namespaces/{NS}/pods/{name}"))
            and p["status"].get("phase") == "Failed"
            and p
        ),
        f"pod {name} to run and fail with exit 3",
    )
    node = pod["spec"]["nodeName"]
    assert node in cluster.nodes  # bound by kube-scheduler, not by the test
    state = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert state["exitCode"] == 3
    conditions = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert conditions["PodScheduled"] == "True" and conditions["Ready"] == "False"
    log = cluster.nodes[node].kubelet.log_tail(name)
    assert log.strip() == f"{node} {pod['metadata']['uid']}"
    cluster.kubectl.ok("delete", "pod", name, "-n", NS, "--wait=true", "--timeout=60s")


def test_delete_runs_prestop_then_stop_signal_within_grace(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.namespace(NS)
    name = f"stop-{uuid.uuid4().hex[:6]}"
    marker = tmp_path / "prestop-ran"
    # Exit 42 on the stop signal if the preStop hook ran first, 43 if not; SIGTERM: 1.
    code = (
        "import os, signal, sys, time\n"
        f"ran = lambda: os.path.exists({str(marker)!r})\n"
        "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(42 if ran() else 43))\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))\n"
        "time.sleep(120)\n"
    )
    hook = f"import pathlib; pathlib.Path({str(marker)!r}).touch()"
    pod = _pod(
        name,
        code,
        terminationGracePeriodSeconds=20,
        os={"name": "linux"},
        container={
            "lifecycle": {
                "stopSignal": "SIGUSR1",
                "preStop": {"exec": {"command": [sys.executable, "-c", hook]}},
            }
        },
    )
    cluster.kubectl.apply(pod)
    running = wait(
        lambda: (
            (p := cluster.rest.find(f"/api/v1/namespaces/{NS}/pods/{name}"))
            and p["status"].get("phase") == "Running"
            and p
        ),
        f"pod {name} to run",
    )
    assert running["spec"]["containers"][0]["lifecycle"]["stopSignal"] == "SIGUSR1"
    node = cluster.nodes[running["spec"]["nodeName"]]
    cluster.kubectl.ok("delete", "pod", name, "-n", NS, "--wait=true", "--timeout=60s")
    uid = running["metadata"]["uid"]
    # 42: the stop signal after the preStop hook; not SIGTERM (1), not SIGKILL (137).
    assert node.exit_codes[(name, uid)] == 42
    assert cluster.rest.find(f"/api/v1/namespaces/{NS}/pods/{name}") is None
