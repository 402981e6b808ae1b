"""The operator's lifecycle against the real API: restarts of the operator process mid-job
and a spec edit mid-job leave no duplicate children and lose no status; deleting the
RefitJob cascades to every child through kube-controller-manager's garbage collector;
workers that fail use up ``maxRestarts`` and fail the job, unless a worker exits with the
not-retryable code, which fails it at once; a suspended job keeps its rest and resumes in
a new epoch.

A watcher thread polls the job's children for the whole job and keeps every uid it ever
saw, so a child created twice (a second pod of one name, a second ConfigMap) shows up even
if it was deleted again before the end.

Real: the operator process (stopped with SIGTERM and started again, as a Deployment would),
kube-controller-manager's garbage collector, the workers.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from tests.cluster.support import (
    CHILD_KINDS,
    ChildWatch,
    Cluster,
    Install,
    assert_bit_exact,
    example,
    wait,
)

from refit_operator.api import names

NS = "lifecycle"


def _finished(cluster: Cluster, job: str) -> dict[str, Any]:
    status: dict[str, Any] = wait(
        lambda: (s := cluster.job_status(NS, job)).get("phase") in ("Succeeded", "Failed") and s,
        f"job {job} to finish",
        timeout=300,
    )
    return status


def test_operator_restart_mid_job_no_duplicates_no_lost_status(
    cluster: Cluster, install: Install
) -> None:
    cluster.namespace(NS)
    job = example("local", metadata={"name": "restart", "namespace": NS})
    job["spec"]["transfer"]["refits"] = 12
    with ChildWatch(cluster, NS, "restart").running() as watch:
        cluster.kubectl.apply(job)
        # 1: down as soon as the gang exists, before the barrier: the ranks start, publish
        # and wait for a barrier nobody writes until the operator is back.
        wait(lambda: len(cluster.pods(NS, "refit.dev/job=restart")) == 4, "the gang", 30)
        assert install.operator.stop() == 0  # SIGTERM: kopf stops cleanly
        time.sleep(3)
        install.operator.start()
        # 2: down again while refits run.
        wait(
            lambda: cluster.job_status(NS, "restart").get("refitsCompleted", 0) >= 2,
            "two refits before the second restart",
            timeout=180,
        )
        assert install.operator.stop() == 0
        before = cluster.job_status(NS, "restart")
        install.operator.start()
        status = _finished(cluster, "restart")
    assert status["phase"] == "Succeeded", status
    assert (
        status["refitsCompleted"] == 12 and status["refitsCompleted"] >= before["refitsCompleted"]
    )
    assert (status["epoch"], status["restarts"], status["preemptions"]) == (0, 0, 0)
    assert watch.refits == sorted(watch.refits), "refitsCompleted went backwards"
    # One object per child name, each with one uid for the whole job.
    for kind in CHILD_KINDS:
        assert all(len(uids) == 1 for uids in watch.uids(kind).values()), (kind, watch.uids(kind))
    assert len(watch.uids("pods")) == 4
    # The rendezvous maps: the operator's, then each role's (one block each at 2 + 2 ranks).
    assert sorted(watch.uids("configmaps")) == sorted(
        names.rendezvous_maps(
            "restart", job["spec"]["policy"]["replicas"], job["spec"]["rollout"]["replicas"]
        )
    )
    assert install.operator.forbidden() == []


def test_spec_edit_mid_job_then_delete_cascades_through_the_gc(
    cluster: Cluster, install: Install
) -> None:
    cluster.namespace(NS)
    job = example("local", metadata={"name": "edit", "namespace": NS})
    job["spec"]["transfer"]["refits"] = 12
    with ChildWatch(cluster, NS, "edit").running() as watch:
        cluster.kubectl.apply(job)
        wait(
            lambda: cluster.job_status(NS, "edit").get("refitsCompleted", 0) >= 2,
            "two refits before the edit",
            timeout=180,
        )
        cluster.kubectl.ok(
            "patch",
            "rj",
            "edit",
            "-n",
            NS,
            "--type=merge",
            "-p",
            # policy.replicas: a spec change (rollout.replicas would be a scale).
            '{"spec":{"policy":{"replicas":1}}}',
        )
        status = _finished(cluster, "edit")
        children = watch.children()
    assert status["phase"] == "Succeeded", status
    assert status["refitsCompleted"] == 12, status
    # A spec change recreates every pod in a new epoch (the rollout replicas at their
    # next generation); it is neither a failure nor a preemption.
    assert (status["epoch"], status["restarts"], status["preemptions"]) == (1, 0, 0)
    assert status["observedGeneration"] == 2 and status["policy"]["desired"] == 1
    assert watch.refits == sorted(watch.refits), "refitsCompleted went backwards"
    pods = watch.uids("pods")
    assert all(len(uids) == 1 for uids in pods.values()), pods  # a name per incarnation
    final = cluster.gang_exit_codes(NS, "edit", 1)
    assert sorted(final) == ["edit-policy-0-e1", "edit-rollout-0-g1", "edit-rollout-1-g1"]
    assert_bit_exact(final, ranks=3)

    # Delete the job: the garbage collector removes every child it owned.
    owned = {(k, o["metadata"]["name"]) for k, items in children.items() for o in items}
    assert {k for k, _ in owned} == set(CHILD_KINDS)
    cluster.kubectl.ok("delete", "rj", "edit", "-n", NS, "--wait=true", "--timeout=120s")
    wait(
        lambda: not any(watch.children().values()),
        f"the garbage collector to delete {sorted(owned)}",
        timeout=120,
    )


def test_failing_workers_restart_until_max_restarts_then_fail(
    cluster: Cluster, install: Install
) -> None:
    cluster.namespace(NS)
    job = example("local", metadata={"name": "fails", "namespace": NS})
    job["spec"]["policy"]["command"] = [sys.executable, "-c", "import sys; sys.exit(1)"]
    job["spec"]["failurePolicy"] = {"maxRestarts": 1, "backoffSeconds": 1}
    cluster.kubectl.apply(job)
    status = _finished(cluster, "fails")
    assert status["phase"] == "Failed", status
    assert (status["restarts"], status["preemptions"], status["epoch"]) == (1, 0, 1)
    assert "failed: exit code 1; maxRestarts (1) used up" in status["message"]
    wait(
        lambda: all(
            p["status"]["phase"] in ("Succeeded", "Failed")
            for p in cluster.pods(NS, "refit.dev/job=fails")
        ),
        "the failed gang's pods to stop",
        timeout=60,
    )
    reasons = [
        e["reason"]
        for e in cluster.kubectl.json("get", "events", "-n", NS)["items"]
        if e["involvedObject"]["name"] == "fails"
    ]
    assert "Failed" in reasons, reasons
    cluster.kubectl.ok("delete", "rj", "fails", "-n", NS, "--wait=true", "--timeout=120s")


#: A rank that finds what it was given unusable: it says why in its termination message
#: and exits with the code the operator does not retry.
NOT_RETRYABLE_RANK = """
import os, sys
from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.exits import EXIT_NOT_RETRYABLE
path = WorkerConfig.from_env(os.environ).termination_message_path
with open(path, "w") as f:
    f.write("dtype float8_e4m3fn is not supported by this engine\\n")
sys.exit(EXIT_NOT_RETRYABLE)
"""


def test_a_not_retryable_exit_fails_the_job_at_once(cluster: Cluster, install: Install) -> None:
    cluster.namespace(NS)
    job = example("local", metadata={"name": "no-retry", "namespace": NS})
    job["spec"]["rollout"]["command"] = [sys.executable, "-c", NOT_RETRYABLE_RANK]
    job["spec"]["failurePolicy"] = {"maxRestarts": 3, "backoffSeconds": 1}
    cluster.kubectl.apply(job)
    status = _finished(cluster, "no-retry")
    assert status["phase"] == "Failed", status
    # At once: no restart, no new epoch, nothing counted.
    assert (status["restarts"], status["preemptions"], status["epoch"]) == (0, 0, 0), status
    said = "failed: exit code 84: dtype float8_e4m3fn is not supported by this engine"
    assert said in status["message"] and "not retryable" in status["message"], status
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "NotRetryable"), failed
    reasons = [
        e["reason"]
        for e in cluster.kubectl.json("get", "events", "-n", NS)["items"]
        if e["involvedObject"]["name"] == "no-retry"
    ]
    assert "Failed" in reasons and "Restarted" not in reasons, reasons
    cluster.kubectl.ok("delete", "rj", "no-retry", "-n", NS, "--wait=true", "--timeout=120s")


def test_a_checkpoint_the_worker_cannot_move_fails_the_job_at_once(
    cluster: Cluster, install: Install, tmp_path: Path
) -> None:
    """The real refit-worker on a safetensors checkpoint with a uint16 tensor: it exits
    84 naming the tensor, and the job fails at once, with no restart and no backoff."""
    import torch
    from safetensors.torch import save_file

    cluster.namespace(NS)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    weights = {
        "embed.weight": torch.zeros(64, 32),
        "router.counts": torch.zeros(16).to(torch.uint16),
    }
    save_file(weights, str(ckpt / "model.safetensors"))
    # The claim exists and is bound, as a real one would be (the scheduler holds a pod
    # whose claim is missing); each process node serves it from the local directory.
    cluster.kubectl.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": "lifecycle-ckpt-u16"},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "manual",
                    "hostPath": {"path": str(ckpt)},
                },
            },
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "ckpt-u16", "namespace": NS},
                "spec": {
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "manual",
                    "volumeName": "lifecycle-ckpt-u16",
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
        ]
    )
    wait(
        lambda: (
            cluster.kubectl.json("get", "pvc", "ckpt-u16", "-n", NS)["status"].get("phase")
            == "Bound"
        ),
        "claim ckpt-u16 to be bound",
        timeout=60,
    )
    for node in cluster.nodes.values():
        node.kubelet.serve_claim("ckpt-u16", ckpt)
    job = example("local", metadata={"name": "u16", "namespace": NS})
    job["spec"]["weights"] = {"safetensors": {"claimName": "ckpt-u16"}}
    job["spec"]["failurePolicy"] = {"maxRestarts": 3, "backoffSeconds": 10}
    cluster.kubectl.apply(job)
    status = _finished(cluster, "u16")
    assert status["phase"] == "Failed", status
    assert (status["restarts"], status["preemptions"], status["epoch"]) == (0, 0, 0), status
    assert "exit code 84" in status["message"], status
    assert "'router.counts' has dtype uint16" in status["message"], status
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "NotRetryable", failed
    cluster.kubectl.ok("delete", "rj", "u16", "-n", NS, "--wait=true", "--timeout=120s")
    cluster.kubectl.ok("delete", "pvc", "ckpt-u16", "-n", NS, "--wait=false")
    cluster.kubectl.ok("delete", "pv", "lifecycle-ckpt-u16", "--wait=false")


def test_suspend_mid_job_keeps_the_rest_and_resumes_in_a_new_epoch(
    cluster: Cluster, install: Install
) -> None:
    cluster.namespace(NS)
    job = example("local", metadata={"name": "pause", "namespace": NS})
    job["spec"]["transfer"]["refits"] = 12
    cluster.kubectl.apply(job)
    wait(
        lambda: cluster.job_status(NS, "pause").get("refitsCompleted", 0) >= 1,
        "a refit before the suspend",
        timeout=180,
    )
    cluster.kubectl.ok(
        "patch", "rj", "pause", "-n", NS, "--type=merge", "-p", '{"spec":{"suspend":true}}'
    )
    cluster.kubectl.ok(
        "wait", "rj/pause", "-n", NS, "--for=jsonpath={.status.phase}=Suspended", "--timeout=60s"
    )
    wait(lambda: not cluster.pods(NS, "refit.dev/job=pause"), "the pods deleted on suspend", 60)
    for kept in names.rendezvous_maps("pause", 2, 2):  # the operator's map and each role's
        assert cluster.rest.find(f"/api/v1/namespaces/{NS}/configmaps/{kept}"), kept
    cluster.kubectl.ok(
        "patch", "rj", "pause", "-n", NS, "--type=merge", "-p", '{"spec":{"suspend":false}}'
    )
    status = _finished(cluster, "pause")
    assert status["phase"] == "Succeeded" and status["refitsCompleted"] == 12, status
    assert (status["restarts"], status["preemptions"]) == (0, 0) and status["epoch"] >= 1
    cluster.kubectl.ok("delete", "rj", "pause", "-n", NS, "--wait=true", "--timeout=120s")
