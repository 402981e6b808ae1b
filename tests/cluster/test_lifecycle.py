"""The operator's lifecycle against the real API: a restart of the operator process
mid-job and a spec edit mid-job leave no duplicate children and lose no status; deleting
the RefitJob cascades to every child through kube-controller-manager's garbage collector.

A watcher thread polls the job's children for the whole job and keeps every uid it ever
saw, so a child created twice (a second pod of one name, a second ConfigMap) shows up even
if it was deleted again before the end.

Real: the operator process (stopped with SIGTERM and started again, as a Deployment would),
kube-controller-manager's garbage collector, the workers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.cluster.support import Cluster, Install, example, wait

NS = "lifecycle"
KINDS = {
    "pods": "/api/v1/namespaces/{ns}/pods",
    "configmaps": "/api/v1/namespaces/{ns}/configmaps",
    "services": "/api/v1/namespaces/{ns}/services",
    "serviceaccounts": "/api/v1/namespaces/{ns}/serviceaccounts",
    "roles": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "rolebindings": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
}


class ChildWatch:
    """Every (kind, name, uid) of a job's children seen, and the job's refit counts."""

    def __init__(self, cluster: Cluster, job: str) -> None:
        self.cluster, self.job = cluster, job
        self.seen: set[tuple[str, str, str]] = set()
        self.refits: list[int] = []
        self._stop = threading.Event()

    def children(self) -> dict[str, list[dict[str, Any]]]:
        out = {}
        for kind, path in KINDS.items():
            listed = self.cluster.rest.get(
                path.format(ns=NS), labelSelector=f"refit.dev/job={self.job}"
            )
            out[kind] = listed["items"]
        return out

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            for kind, items in self.children().items():
                self.seen |= {(kind, o["metadata"]["name"], o["metadata"]["uid"]) for o in items}
            refits = self.cluster.job_status(NS, self.job).get("refitsCompleted")
            if refits is not None:
                self.refits.append(int(refits))

    @contextmanager
    def running(self) -> Iterator[ChildWatch]:
        thread = threading.Thread(target=self._poll, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(10)

    def uids(self, kind: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for k, name, uid in self.seen:
            if k == kind:
                out.setdefault(name, set()).add(uid)
        return out


def _finished(cluster: Cluster, job: str) -> dict[str, Any]:
    return wait(
        lambda: (s := cluster.job_status(NS, job)).get("phase") in ("Succeeded", "Failed") and s,
        f"job {job} to finish",
        timeout=300,
    )


def test_operator_restart_mid_job_no_duplicates_no_lost_status(
    cluster: Cluster, install: Install
) -> None:
    cluster.namespace(NS)
    job = example("local", metadata={"name": "restart", "namespace": NS})
    job["spec"]["transfer"]["refits"] = 12
    with ChildWatch(cluster, "restart").running() as watch:
        cluster.kubectl.apply(job)
        wait(
            lambda: cluster.job_status(NS, "restart").get("refitsCompleted", 0) >= 2,
            "two refits before the restart",
            timeout=180,
        )
        assert install.operator.stop() == 0  # SIGTERM: kopf stops cleanly
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
    for kind in KINDS:
        assert all(len(uids) == 1 for uids in watch.uids(kind).values()), (kind, watch.uids(kind))
    assert len(watch.uids("pods")) == 4
    assert set(watch.uids("configmaps")) == {"restart-rendezvous"}
    assert install.operator.forbidden() == []


def test_spec_edit_mid_job_then_delete_cascades_through_the_gc(
    cluster: Cluster, install: Install
) -> None:
    cluster.namespace(NS)
    job = example("local", metadata={"name": "edit", "namespace": NS})
    job["spec"]["transfer"]["refits"] = 12
    with ChildWatch(cluster, "edit").running() as watch:
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
            '{"spec":{"rollout":{"replicas":1}}}',
        )
        status = _finished(cluster, "edit")
        children = watch.children()
    assert status["phase"] == "Succeeded", status
    assert status["refitsCompleted"] == 12, status
    # A spec change recreates the gang in a new epoch; it is neither a failure nor a
    # preemption.
    assert (status["epoch"], status["restarts"], status["preemptions"]) == (1, 0, 0)
    assert status["observedGeneration"] == 2 and status["rollout"]["total"] == 1
    assert watch.refits == sorted(watch.refits), "refitsCompleted went backwards"
    pods = watch.uids("pods")
    assert all(len(uids) <= 2 for uids in pods.values()), pods  # one per epoch at most
    final = [p for p in children["pods"] if p["metadata"]["labels"]["refit.dev/epoch"] == "1"]
    assert sorted(p["metadata"]["name"] for p in final) == [
        "edit-policy-0",
        "edit-policy-1",
        "edit-rollout-0",
    ]
    codes = cluster.exit_codes()
    assert [codes[(p["metadata"]["name"], p["metadata"]["uid"])] for p in final] == [0, 0, 0]

    # Delete the job: the garbage collector removes every child it owned.
    owned = {(k, o["metadata"]["name"]) for k, items in children.items() for o in items}
    assert {k for k, _ in owned} == set(KINDS)
    cluster.kubectl.ok("delete", "rj", "edit", "-n", NS, "--wait=true", "--timeout=120s")
    wait(
        lambda: not any(watch.children().values()),
        f"the garbage collector to delete {sorted(owned)}",
        timeout=120,
    )
