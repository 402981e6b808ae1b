"""A process node that dies (its heartbeat stops, every process on it is SIGKILLed) is
marked ``Ready Unknown`` by the real kube-controller-manager within its node-monitor bound,
its pods stay in the API as it left them, and the operator's own reading (a GET per Node,
the pure decision) finds them lost; once a person taints the node out of service, the
operator's force delete (grace 0, uid precondition) removes them, a stuck ``Terminating``
one included, while a delete naming another uid removes nothing.

Real: the control plane (the node-lifecycle controller, the apiserver's DeleteOptions),
the process node's processes and signals, the operator's client (``kube.Kube``),
``KubeWrites`` and the pure decision.  The node is a third one made for this module, so
the session's two nodes stay alive for the other tests.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from tests.cluster import records
from tests.cluster.controlplane import NODE_MONITOR_GRACE_S, NODE_MONITOR_PERIOD_S
from tests.cluster.node import ProcessNode, lease_ns
from tests.cluster.rest import ApiError
from tests.cluster.support import Cluster, Install, example, wait

from refit_operator.core import lost_nodes
from refit_operator.core.decision import Delete
from refit_operator.core.nodes import OUT_OF_SERVICE
from refit_operator.core.observe import observe
from refit_operator.render.pods import RenderOptions
from refit_operator.shell import kube
from refit_operator.shell.controller import Controller
from refit_operator.shell.kube_writes import KubeWrites

T = TypeVar("T")
NS = "node-death"
#: What the node-lifecycle controller is given (its grace and period), and room for a
#: loaded machine: the wait's bound, not a timed assertion (the measured time is printed).
MARKED_BOUND_S = NODE_MONITOR_GRACE_S + NODE_MONITOR_PERIOD_S + 50


#: Only pods that tolerate it and select it go to the node that will die.
DYING = {"key": "refit.dev/dying", "value": "yes", "effect": "NoSchedule"}


@pytest.fixture
def dying(cluster: Cluster, tmp_path: Path) -> Iterator[ProcessNode]:
    name = f"node-dies-{uuid.uuid4().hex[:6]}"
    # Tainted so that kube-scheduler puts no other test's pod here.
    node = ProcessNode(
        name,
        cluster.rest,
        tmp_path / name,
        cluster.network,
        taints=[DYING],
        labels={DYING["key"]: DYING["value"]},
    )
    node.start()
    try:
        yield node
    finally:
        node.stop(timeout=10)
        for path in (
            f"/api/v1/nodes/{name}",
            f"/apis/coordination.k8s.io/v1/namespaces/{lease_ns()}/leases/{name}",
        ):
            try:
                cluster.rest.delete(path)
            except ApiError as exc:
                if exc.status != 404:
                    raise


def _pod(name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"test": "node-death"}},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 30,
            "containers": [
                {
                    "name": "main",
                    "image": "none",
                    "command": [sys.executable, "-c", "import time; time.sleep(3600)"],
                }
            ],
        },
    }


def _client(cluster: Cluster) -> kube.Kube:
    """The operator's own API client, with the admin's token."""
    context = ssl.create_default_context(cafile=str(cluster.plane.ca_file))
    token = cluster.plane.token
    return kube.Kube(
        cluster.plane.server,
        headers=lambda: {"Authorization": f"Bearer {token}"},
        ssl_context=context,
    )


def _with_api(cluster: Cluster, call: Callable[[kube.Kube], Awaitable[T]]) -> T:
    """``call`` with a fresh operator client on a loop of its own (a client is bound to
    the loop it first ran on)."""

    async def run() -> T:
        api = _client(cluster)
        try:
            return await call(api)
        finally:
            await api.close()

    return asyncio.run(run())


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting to be reaped (SIGKILLed: it runs no more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _ready(cluster: Cluster, node: str) -> dict[str, Any]:
    found = cluster.rest.get(f"/api/v1/nodes/{node}")
    return next(c for c in found["status"]["conditions"] if c["type"] == "Ready")


def _observe(cluster: Cluster, pods: list[dict[str, Any]], bound: float) -> Any:
    """What a controller round observes: the controller's own GET per node its pods are
    on, then the pure observation."""

    async def read(api: kube.Kube) -> Any:
        return await Controller(api, RenderOptions()).read_nodes(pods)

    nodes = _with_api(cluster, read)
    return observe(pods, [], {}, nodes=nodes, now=datetime.now(UTC), node_lost_seconds=bound)


def _pods(cluster: Cluster) -> list[dict[str, Any]]:
    listed = cluster.rest.get(f"/api/v1/namespaces/{NS}/pods", labelSelector="test=node-death")
    return list(listed.get("items") or [])


def test_a_dead_node_is_marked_and_its_pods_are_lost_then_force_deleted(
    cluster: Cluster, dying: ProcessNode
) -> None:
    cluster.namespace(NS)
    names = [f"on-dying-{i}-{uuid.uuid4().hex[:4]}" for i in range(2)]
    for name in names:
        cluster.kubectl.apply(_pod(name, dying.name))
    wait(
        lambda: len([p for p in _pods(cluster) if p["status"].get("phase") == "Running"]) == 2,
        f"both pods Running on {dying.name}",
        timeout=120,
    )
    pids = dying.kubelet.pids()
    assert sorted(pids) == sorted(names)

    died = time.monotonic()
    killed = dying.die()
    assert sorted(killed) == sorted(pids.values())
    wait(lambda: all(_dead(pid) for pid in killed), "the SIGKILLed process groups to be dead", 30)
    ready = wait(
        lambda: (r := _ready(cluster, dying.name))["status"] != "True" and r,
        f"kube-controller-manager to mark {dying.name} not ready",
        timeout=MARKED_BOUND_S,
    )
    marked_s = time.monotonic() - died
    assert ready["status"] == "Unknown", ready  # no kubelet said anything: unreachable
    records.record(
        "node death",
        f"a dead process node was marked Ready {ready['status']} {marked_s:.1f} s after it "
        f"died (node-monitor grace {NODE_MONITOR_GRACE_S} s, period {NODE_MONITOR_PERIOD_S} s;"
        f" the wait's bound {MARKED_BOUND_S} s)",
    )
    # The pods stay as the dead node left them: Running, nobody to say otherwise.
    pods = _pods(cluster)
    assert sorted(p["metadata"]["name"] for p in pods) == sorted(names)
    assert {p["status"]["phase"] for p in pods} == {"Running"}

    patient = _observe(cluster, pods, bound=3600.0)
    assert [p.node_lost for p in patient.pods] == [None, None]  # within the bound
    left = lost_nodes.recheck_after(patient)
    assert left is not None and 0 < left <= 3600.0
    seen = _observe(cluster, pods, bound=0.0)
    assert {p.name: p.node for p in seen.pods} == dict.fromkeys(names, dying.name)
    for pod in seen.pods:
        assert pod.node_lost is not None
        assert pod.node_lost.startswith(f"node {dying.name} unreachable (Ready Unknown) for ")
    assert lost_nodes.force_deletes(seen) == []  # nobody said it is out of service
    _force_delete(cluster, names, dying)


def _force_delete(cluster: Cluster, names: list[str], dying: ProcessNode) -> None:
    # A graceful delete of one pod leaves it Terminating: no kubelet will ever finish it.
    cluster.kubectl.ok("delete", "pod", names[0], "-n", NS, "--wait=false")
    stuck = cluster.rest.get(f"/api/v1/namespaces/{NS}/pods/{names[0]}")
    assert stuck["metadata"].get("deletionTimestamp")
    # A person says the node is shut down.  NoSchedule: the taint manager evicts nothing,
    # so the running pod is removed by the operator's force delete alone (kube's pod GC
    # may also take the Terminating one; either way it must go, and a 404 is no error).
    cluster.kubectl.ok(
        "taint", "node", dying.name, f"{OUT_OF_SERVICE}=nodeshutdown:NoSchedule", "--overwrite"
    )
    seen = _observe(cluster, _pods(cluster), bound=3600.0)
    assert {p.node_lost for p in seen.pods} == {f"node {dying.name} is out of service"}
    forced = lost_nodes.force_deletes(seen)
    assert sorted(d.name for d in forced) == sorted(names)
    job = {"metadata": {"name": "none", "namespace": NS, "resourceVersion": "1", "uid": "u"}}

    def delete(*actions: Delete) -> Callable[[kube.Kube], Awaitable[list[Any]]]:
        async def go(api: kube.Kube) -> list[Any]:
            writes = KubeWrites(api, job)
            return [await writes.delete(a) for a in actions]

        return go

    # Another uid under the name (a successor's): refused by the precondition, nothing goes.
    other = Delete("v1", "Pod", names[1], grace_period_seconds=0, uid=str(uuid.uuid4()))
    assert _with_api(cluster, delete(other)) == [None]
    assert cluster.rest.find(f"/api/v1/namespaces/{NS}/pods/{names[1]}") is not None
    assert _with_api(cluster, delete(*forced)) == [None, None]
    # Grace 0: gone at once, with no kubelet to confirm (a read, not a wait).
    assert _pods(cluster) == []


def _node_lost_events(cluster: Cluster, uid: str) -> list[dict[str, Any]]:
    items = cluster.rest.get(f"/apis/events.k8s.io/v1/namespaces/{NS}/events")["items"]
    return [e for e in items if e["regarding"].get("uid") == uid and e["reason"] == "NodeLost"]


def _job_on(node: ProcessNode) -> dict[str, Any]:
    """A long job whose rollout pods run on ``node`` alone (its policy pods elsewhere)."""
    job = example("local", metadata={"name": "lost-node", "namespace": NS})
    # Long enough to be mid-job when the node dies, and a refit timeout longer than the
    # node-lost bound, so the lost pods are still not deleting when the bound ends.
    job["spec"]["transfer"].update(refits=100000, timeoutSeconds=600)
    job["spec"]["rollout"]["template"] = {
        "spec": {
            "nodeSelector": {DYING["key"]: DYING["value"]},
            "tolerations": [{**DYING, "operator": "Equal"}],
            "containers": [{"name": "worker"}],  # the operator's own container, by name
        }
    }
    return job


def test_the_operator_announces_pods_lost_with_a_dead_node_and_force_deletes_them(
    cluster: Cluster, install: Install, dying: ProcessNode
) -> None:
    """The operator itself, unprompted by any pod change once the node is marked: the
    NodeLost Event after kube-controller-manager's grace plus nodeLostSeconds (30, the
    default), then, once a person taints the node out of service, the force delete."""
    cluster.namespace(NS)
    cluster.kubectl.apply(_job_on(dying))
    wait(
        lambda: cluster.job_status(NS, "lost-node").get("refitsCompleted", 0) >= 1,
        "the job's first refit",
        timeout=240,
    )
    job = cluster.kubectl.json("get", "rj", "lost-node", "-n", NS)
    rollout = {
        p["metadata"]["name"]
        for p in cluster.pods(NS, "refit.dev/job=lost-node,refit.dev/role=rollout")
    }
    on_node = {
        p["metadata"]["name"] for p in cluster.pods(NS) if p["spec"].get("nodeName") == dying.name
    }
    assert rollout and on_node == rollout
    died = time.monotonic()
    dying.die()
    bound = NODE_MONITOR_GRACE_S + NODE_MONITOR_PERIOD_S + 30 + lost_nodes.NODE_RECHECK_S
    events = wait(
        lambda: _node_lost_events(cluster, job["metadata"]["uid"]),
        f"the operator's NodeLost Event about {dying.name}",
        timeout=bound + 90,
    )
    announced_s = time.monotonic() - died
    note = events[0]["note"]
    assert events[0]["type"] == "Warning"
    assert note.startswith(f"node {dying.name} unreachable (Ready Unknown) since "), note
    assert all(name in note for name in rollout), note
    cluster.kubectl.ok(
        "taint", "node", dying.name, f"{OUT_OF_SERVICE}=nodeshutdown:NoSchedule", "--overwrite"
    )
    tainted = time.monotonic()
    wait(
        lambda: (
            not [
                p
                for p in cluster.pods(NS)
                if p["metadata"]["name"] in rollout and p["spec"].get("nodeName") == dying.name
            ]
        ),
        f"the operator to force-delete the pods on out-of-service {dying.name}",
        timeout=lost_nodes.NODE_RECHECK_S + 90,
    )
    deleted_s = time.monotonic() - tainted
    records.record(
        "node death",
        f"the operator announced NodeLost {announced_s:.1f} s after the node died (node-monitor"
        f" grace {NODE_MONITOR_GRACE_S} s + nodeLostSeconds 30), and force-deleted its pods"
        f" {deleted_s:.1f} s after the out-of-service taint (it looks again every"
        f" {lost_nodes.NODE_RECHECK_S:g} s while pods sit on a lost node)",
    )
    cluster.kubectl.ok("delete", "rj", "lost-node", "-n", NS, "--wait=false")
