"""Per-role failure domains (issue #20) on the real control plane.

A rollout pod SIGKILLed mid-job is replaced alone: the policy pods run on (the nodes never
start another policy pod), the job Succeeds with every refit, and the replacement reports
each refit it committed checked bit for bit.  A ``kubectl drain`` of the node that holds
only rollout pods leaves the policy pods alone.  A node that dies (its agent stops
reporting, every process on it SIGKILLed, its pods left ``Terminating`` for good) does not
stall the job: it finishes on the nodes left within a stated bound.  ``kubectl scale`` up
and down mid-job leaves the policy pods; an autoscaling/v2 HPA targeting the RefitJob is
accepted and the HPA controller reads its scale subresource.  A policy pod SIGKILLed
restarts the policy gang only: the rollout pods keep their uids.

Which pods ran is read from the nodes (``ProcessNode.started``: every pod a node ever
started), not from the API's current list, so a pod created and gone again between two
looks still counts.  The figures are printed at the end of the session.

Real: the operator, kube-scheduler, kube-controller-manager (node lifecycle, taint
eviction, HPA), kubectl drain/scale, the workers (NIXL, gloo, signals).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from tests.cluster import records
from tests.cluster.controlplane import NODE_MONITOR_GRACE_S, NODE_MONITOR_PERIOD_S
from tests.cluster.node import ProcessNode, lease_ns
from tests.cluster.rest import ApiError
from tests.cluster.support import Cluster, Install, example, wait
from tests.support.versions import job_key, served_ranks, trainer_digest

from refit_worker.contract.rendezvous import (
    EntryError,
    ProgressEntry,
    at_home,
    decode_entry,
    parse_key,
    place_of_name,
)

NS = "faildomains"
REFITS = 30
#: The pods' toleration of the unreachable / not-ready taints, and the job's nodeLostSeconds.
TOLERATION_S = 5
NODE_LOST_S = 5
#: The dead-node bound, from the node's death to the job's Succeeded: the node marked
#: (kube-controller-manager's node-monitor grace and period, controlplane.py), its pods
#: lost (nodeLostSeconds), the policy gang and the replicas recreated on the nodes left
#: (their start and connection take ~20-40 s on a loaded 2-core machine), and the refits
#: left done.  The wait's timeout, not a timed assertion: the measured time is recorded.
DEAD_NODE_BOUND_S = NODE_MONITOR_GRACE_S + NODE_MONITOR_PERIOD_S + NODE_LOST_S + 240


#: A template's container: the operator merges its own worker container into this one.
WORKER = [{"name": "worker"}]


def _job(name: str, refits: int = REFITS, **spec: Any) -> dict[str, Any]:
    job = example("local", metadata={"name": name, "namespace": NS})
    job["spec"]["transfer"]["refits"] = refits
    job["spec"].update(spec)
    return job


def _selector(job: str, role: str = "") -> str:
    return f"refit.dev/job={job}" + (f",refit.dev/role={role}" if role else "")


def _started(cluster: Cluster, job: str, role: str) -> dict[str, str]:
    """uid -> pod name of every pod of ``job``'s ``role`` any node ever started."""
    return {
        uid: name
        for node in cluster.nodes.values()
        for ns, name, uid, labels in node.started
        if ns == NS and labels.get("refit.dev/job") == job and labels.get("refit.dev/role") == role
    }


def _live(cluster: Cluster, job: str, role: str) -> list[dict[str, Any]]:
    return [
        p
        for p in cluster.pods(NS, _selector(job, role))
        if not p["metadata"].get("deletionTimestamp")
    ]


def _rank_pod(cluster: Cluster, job: str, role: str, rank: int) -> dict[str, Any]:
    pod: dict[str, Any] = wait(
        lambda: next(
            (
                p
                for p in _live(cluster, job, role)
                if p["metadata"]["labels"].get("refit.dev/rank") == str(rank)
                and p.get("status", {}).get("phase") == "Running"
            ),
            None,
        ),
        f"a running {role} rank {rank} pod of {job}",
        timeout=120,
    )
    return pod


def _sigkill(cluster: Cluster, pod: dict[str, Any]) -> None:
    """SIGKILL the pod's process group on its node: nothing of it runs on."""
    node = cluster.nodes[pod["spec"]["nodeName"]]
    pid = node.kubelet.pids()[pod["metadata"]["name"]]
    os.killpg(pid, signal.SIGKILL)


def _progress(cluster: Cluster, job: str) -> dict[tuple[str, int], ProgressEntry]:
    """The rollout and policy progress entries of the job's rendezvous: each role's maps,
    each key read only from the map it belongs in (as the operator reads them)."""
    maps = cluster.rest.get(
        f"/api/v1/namespaces/{NS}/configmaps", labelSelector=f"refit.dev/job={job}"
    )
    data: dict[str, str] = {}
    for cm in maps.get("items") or []:
        place = place_of_name(cm["metadata"]["name"])
        if place is not None and place[0] is not None:  # a role's map
            data.update(at_home(place, cm.get("data") or {}))
    out: dict[tuple[str, int], ProgressEntry] = {}
    for key, value in data.items():
        parsed = parse_key(key)
        if parsed is None or parsed.kind != "progress":
            continue
        with contextlib.suppress(EntryError):
            entry = decode_entry(key, value)
            if isinstance(entry, ProgressEntry):
                out[(entry.role, entry.rank)] = entry
    return out


def _refits(cluster: Cluster, job: str, at_least: int) -> dict[str, Any]:
    status: dict[str, Any] = wait(
        lambda: (s := cluster.job_status(NS, job)).get("refitsCompleted", 0) >= at_least and s,
        f"{job} to commit {at_least} refit(s)",
        timeout=240,
    )
    assert status["refitsCompleted"] < REFITS, f"{job} finished before the fault; raise REFITS"
    return status


def _finished(cluster: Cluster, job: str, timeout: float = 400) -> dict[str, Any]:
    status: dict[str, Any] = wait(
        lambda: (s := cluster.job_status(NS, job)).get("phase") in ("Succeeded", "Failed") and s,
        f"{job} to finish",
        timeout=timeout,
    )
    return status


def _events(cluster: Cluster, job: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.kubectl.json("get", "events", "-n", NS)["items"]
    return [e for e in items if e["involvedObject"]["name"] == job]


def _exit_code(cluster: Cluster, name: str, uid: str) -> int:
    # The code itself may be 0, which is no answer to wait(): wait for the key.
    wait(lambda: (name, uid) in cluster.exit_codes(), f"pod {name} ({uid[:8]}) to exit", 60)
    return cluster.exit_codes()[(name, uid)]


def _delete(cluster: Cluster, job: str) -> None:
    cluster.kubectl.ok("delete", "rj", job, "-n", NS, "--wait=true", "--timeout=120s")


def test_a_rollout_pod_sigkilled_mid_job_is_replaced_alone(
    cluster: Cluster, install: Install
) -> None:
    job = "fd-kill-rollout"
    cluster.namespace(NS)
    cluster.kubectl.apply(_job(job))
    before = _refits(cluster, job, 2)
    policy = _started(cluster, job, "policy")
    victim = _rank_pod(cluster, job, "rollout", 0)
    killed = victim["metadata"]["uid"]
    _sigkill(cluster, victim)
    killed_at = time.monotonic()
    replacement: ProgressEntry = wait(
        lambda: next(
            (
                e
                for (role, rank), e in _progress(cluster, job).items()
                # Its first commit, seeded by a peer or sent by the policy (issue #31).
                if role == "rollout" and rank == 0 and e.uid != killed and e.seed is not None
            ),
            None,
        ),
        "the replacement of rollout rank 0 to commit a refit",
        timeout=240,
    )
    first_commit_s = time.monotonic() - killed_at
    status = _finished(cluster, job)
    assert status["phase"] == "Succeeded", status
    assert status["refitsCompleted"] == REFITS, status
    # The policy pods are the same pods: no node ever started another one.
    assert _started(cluster, job, "policy") == policy, "the policy pods were recreated"
    assert (status["epoch"], status["restarts"]) == (0, 0), status
    assert status["rollout"]["replacements"] >= 1, status
    assert _exit_code(cluster, victim["metadata"]["name"], killed) == 128 + signal.SIGKILL
    # The replacement: a new pod under a new name, each refit it committed checked bit for
    # bit, and it exited 0 (a mismatch exits 1).
    names = _started(cluster, job, "rollout")
    assert names[replacement.uid] != victim["metadata"]["name"], names
    last = _progress(cluster, job)[("rollout", 0)]
    assert last.uid == replacement.uid and last.verification == "bit-exact", last
    replicas = {r["rank"]: r for r in status["rolloutReplicas"]}
    assert replicas[0]["generation"] >= 1 and replicas[0]["pod"] == names[replacement.uid]
    # The ledger (issue #32): the replacement serves the trainer's last refit, byte for
    # byte the same as its peer.
    last_digest = trainer_digest(_job(job)["spec"], REFITS - 1)
    key = job_key(e["message"] for e in _events(cluster, job))
    ledger = [{"refit": REFITS - 1, "digest": last_digest, "replicas": [0, 1], "signedBy": key}]
    assert status["versions"] == ledger, status["versions"]
    reasons = [e["reason"] for e in _events(cluster, job)]
    assert "RolloutReplaced" in reasons and "Restarted" not in reasons, reasons
    seed = replacement.seed
    assert seed is not None  # what the wait above waited for
    records.record(
        "kill-rollout scenario",
        f"{victim['metadata']['name']} SIGKILLed at refits {before['refitsCompleted']}/{REFITS};"
        f" its replacement {names[replacement.uid]} committed its first refit (refit "
        f"{seed.refit}, {_source(seed.source)}) "
        f"{first_commit_s:.1f} s after the kill; job "
        f"Succeeded {status['refitsCompleted']}/{REFITS}, restarts {status['restarts']}, "
        f"replacements {status['rollout']['replacements']}, policy uids unchanged "
        f"({len(policy)}), replacement verification {last.verification}",
    )
    assert _exit_code(cluster, names[replacement.uid], replacement.uid) == 0
    _delete(cluster, job)


def _source(source: str) -> str:
    return "sent by the policy" if source == "policy" else f"seeded from {source}"


@contextlib.contextmanager
def _cordoned(cluster: Cluster, *nodes: str) -> Iterator[None]:
    for node in nodes:
        cluster.kubectl.ok("cordon", node)
    try:
        yield
    finally:
        for node in nodes:
            cluster.kubectl.ok("uncordon", node)


def _pinned(role_template: dict[str, Any], node: str) -> dict[str, Any]:
    """A role template that requires ``node``."""
    spec = {"nodeSelector": {"kubernetes.io/hostname": node}, "containers": WORKER}
    return {**role_template, "template": {"spec": spec}}


def _preferring(role_template: dict[str, Any], node: str) -> dict[str, Any]:
    """A role template that prefers ``node`` (its replacements may go elsewhere)."""
    term = {
        "weight": 100,
        "preference": {
            "matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}
            ]
        },
    }
    affinity = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {**role_template, "template": {"spec": {"affinity": affinity, "containers": WORKER}}}


def test_drain_of_a_node_with_only_rollout_pods_leaves_the_policy_pods(
    cluster: Cluster, install: Install
) -> None:
    job = "fd-drain"
    policy_node, rollout_node = "node-a", "node-b"
    cluster.namespace(NS)
    doc = _job(job)
    doc["spec"]["policy"] = _pinned(doc["spec"]["policy"], policy_node)
    doc["spec"]["rollout"] = _preferring(doc["spec"]["rollout"], rollout_node)
    # A grace period long enough for a replacement to start on a loaded machine: a
    # drained pod hands over for half of it (issue #31).
    doc["spec"]["preemption"]["gracePeriodSeconds"] = 90
    cluster.kubectl.apply(doc)
    before = _refits(cluster, job, 2)
    placed = {
        p["metadata"]["name"]: p["spec"]["nodeName"] for p in cluster.pods(NS, _selector(job))
    }
    rollout_before = {p["metadata"]["uid"] for p in _live(cluster, job, "rollout")}
    assert {n for name, n in placed.items() if "-rollout-" in name} == {rollout_node}, placed
    assert {n for name, n in placed.items() if "-policy-" in name} == {policy_node}, placed
    policy = _started(cluster, job, "policy")
    try:
        cluster.kubectl.ok(
            "drain",
            rollout_node,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--timeout=120s",
            timeout=150,
        )
        status = _finished(cluster, job)
    finally:
        cluster.kubectl.ok("uncordon", rollout_node)
    assert status["phase"] == "Succeeded", status
    assert status["refitsCompleted"] == REFITS, status
    assert _started(cluster, job, "policy") == policy, "a drain of rollout pods moved the policy"
    assert (status["epoch"], status["restarts"]) == (0, 0), status
    assert status["rollout"]["replacements"] >= 2, status
    # The drained replicas stopped on their own at a safe point (83) and their
    # replacements ran on the node left.
    rollout = _started(cluster, job, "rollout")
    for uid in rollout_before:
        assert _exit_code(cluster, rollout[uid], uid) == 83, (rollout[uid], cluster.exit_codes())
    nodes_after = {
        node.name
        for node in cluster.nodes.values()
        for _, _, uid, _ in node.started
        if uid in set(rollout) - rollout_before
    }
    assert nodes_after == {policy_node}, nodes_after
    handed = [_handed_over(cluster, rollout[uid], uid) for uid in rollout_before]
    records.record(
        "drain hand-over scenario",
        "; ".join(
            f"{old} exited {gap:.1f} s after its replacement served ({how})"
            for old, gap, how in handed
        ),
    )
    records.record(
        "drain-rollout-node scenario",
        f"{rollout_node} (rollout pods only) drained at refits {before['refitsCompleted']}/"
        f"{REFITS}: Succeeded {status['refitsCompleted']}/{REFITS}, epoch {status['epoch']}, "
        f"restarts {status['restarts']}, replacements {status['rollout']['replacements']}, "
        f"policy uids unchanged ({len(policy)})",
    )
    _delete(cluster, job)


def _at(text: str, needle: str) -> float:
    """When the log line holding ``needle`` was written (seconds since the epoch)."""
    line = next((ln for ln in text.splitlines() if needle in ln), None)
    assert line is not None, f"no line with {needle!r} in:\n{text}"
    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=UTC)
    return stamp.timestamp()


def _handed_over(cluster: Cluster, name: str, uid: str) -> tuple[str, float, str]:
    """A drained rollout pod stayed until its replacement served: the replacement's first
    commit is logged before the drained pod's exit.  (pod, seconds between, the source)."""
    old = cluster.pod_log(name, uid)
    successor = old.split("handed over to pod ")[1].split()[0].rstrip(";")
    pods = _started(cluster, name.split("-rollout-", maxsplit=1)[0], "rollout")
    new = cluster.pod_log(pods[successor], successor)
    served = min(
        _at(new, "seeded refit") if "seeded refit" in new else math.inf, _at(new, " committed: ")
    )
    exited = _at(old, "exiting with code 83")
    assert served < exited, (name, pods[successor], served, exited)
    source = (
        new.split("seeded refit")[1].split(":")[0].strip() if "seeded refit" in new else "policy"
    )
    return name, exited - served, source


def _tolerating(role_template: dict[str, Any]) -> dict[str, Any]:
    """A role template whose pods tolerate an unreachable / not-ready node for a few
    seconds, as fast-failover clusters set."""
    tolerations = [
        {
            "key": f"node.kubernetes.io/{taint}",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": TOLERATION_S,
        }
        for taint in ("unreachable", "not-ready")
    ]
    return {
        **role_template,
        "template": {"spec": {"tolerations": tolerations, "containers": WORKER}},
    }


def _kill_node(node: ProcessNode) -> None:
    """The node dies: its agent stops reporting and every process on it is SIGKILLed."""
    node.die()


@pytest.fixture
def doomed(cluster: Cluster) -> Iterator[ProcessNode]:
    """A third process node for a test to kill (the session's two must live on); its Node,
    its Lease and the pods it left are removed afterwards."""
    name = f"node-doomed-{uuid.uuid4().hex[:6]}"
    node = ProcessNode(name, cluster.rest, cluster.workdir / name, cluster.network)
    cluster.nodes[name] = node.start()
    try:
        yield node
    finally:
        node.stop(timeout=10)
        stuck = cluster.kubectl.run(
            "get", "pods", "-A", "--field-selector", f"spec.nodeName={name}", "-o", "name"
        )
        for line in stuck.stdout.split():  # only this test's pods ever ran there
            cluster.kubectl.run("delete", line, "-n", NS, "--grace-period=0", "--force")
        for path in (
            f"/api/v1/nodes/{name}",
            f"/apis/coordination.k8s.io/v1/namespaces/{lease_ns()}/leases/{name}",
        ):
            try:
                cluster.rest.delete(path)
            except ApiError as exc:
                if exc.status != 404:
                    raise
        cluster.nodes.pop(name, None)


def test_a_node_that_dies_mid_refit_does_not_stall_the_job(
    cluster: Cluster, install: Install, doomed: ProcessNode
) -> None:
    job = "fd-dead-node"
    cluster.namespace(NS)
    doc = _job(job)
    doc["spec"]["policy"] = _tolerating(doc["spec"]["policy"])
    doc["spec"]["rollout"] = _tolerating(doc["spec"]["rollout"])
    doc["spec"]["failurePolicy"] = {**doc["spec"]["failurePolicy"], "nodeLostSeconds": NODE_LOST_S}
    others = [n for n in cluster.nodes if n != doomed.name]
    # Every pod of the first epoch on the node that will die; the nodes left take the rest.
    with _cordoned(cluster, *others):
        cluster.kubectl.apply(doc)
        wait(
            lambda: (
                (pods := cluster.pods(NS, _selector(job)))
                and len(pods) == 4
                and all(p["spec"].get("nodeName") == doomed.name for p in pods)
            ),
            f"the first pods of {job} bound to {doomed.name}",
            timeout=120,
        )
    before = _refits(cluster, job, 2)
    lost = {p["metadata"]["uid"] for p in cluster.pods(NS, _selector(job))}
    _kill_node(doomed)
    died_at = time.monotonic()
    status = _finished(cluster, job, timeout=DEAD_NODE_BOUND_S)
    took = time.monotonic() - died_at
    assert status["phase"] == "Succeeded", status
    assert status["refitsCompleted"] == REFITS, status
    # The policy gang was restarted once the node was lost (a new epoch), the replicas
    # replaced; the new pods ran on the nodes left, none waited for the stuck ones.
    assert status["epoch"] >= 1 and status["rollout"]["replacements"] >= 2, status
    later = {
        uid: node.name
        for node in cluster.nodes.values()
        for ns, _, uid, labels in node.started
        if ns == NS and labels.get("refit.dev/job") == job and uid not in lost
    }
    assert later and set(later.values()) <= set(others), later
    node_lost = [e for e in _events(cluster, job) if e["reason"] == "NodeLost"]
    assert node_lost and doomed.name in node_lost[0]["message"], node_lost
    stuck = [
        p["metadata"]["name"]
        for p in cluster.pods(NS, _selector(job))
        if p["metadata"]["uid"] in lost
    ]
    records.record(
        "dead-node scenario",
        f"{doomed.name} (all 4 first pods) died at refits {before['refitsCompleted']}/{REFITS}; "
        f"job Succeeded {status['refitsCompleted']}/{REFITS} {took:.0f} s later (bound "
        f"{DEAD_NODE_BOUND_S} s: node-monitor grace {NODE_MONITOR_GRACE_S} + period "
        f"{NODE_MONITOR_PERIOD_S} + nodeLostSeconds {NODE_LOST_S} + 240 to recreate and "
        f"finish), epoch {status['epoch']}, restarts "
        f"{status['restarts']}, preemptions {status['preemptions']}, replacements "
        f"{status['rollout']['replacements']}; pods left Terminating on the dead node: "
        f"{len(stuck)}",
    )
    _delete(cluster, job)


def _scale_of(cluster: Cluster, job: str) -> dict[str, Any]:
    scale: dict[str, Any] = cluster.rest.get(
        f"/apis/refit.dev/v1alpha1/namespaces/{NS}/refitjobs/{job}/scale"
    )
    return scale


def _serving(cluster: Cluster, job: str, replicas: int) -> dict[str, Any]:
    """The status once ``replicas`` rollout replicas are asked for and that many serve."""
    status: dict[str, Any] = wait(
        lambda: (
            (s := cluster.job_status(NS, job)).get("rollout", {}).get("desired") == replicas
            and s["rollout"].get("ready") == replicas
            and len(s.get("rolloutReplicas") or []) == replicas
            and s
        ),
        f"{job} to serve {replicas} rollout replica(s)",
        timeout=240,
    )
    return status


def test_kubectl_scale_up_and_down_mid_job_leaves_the_policy_pods(
    cluster: Cluster, install: Install
) -> None:
    """``kubectl scale`` 1 -> 4 -> 1 mid-job: the policy pods are untouched, the three new
    replicas take the last committed refit from the replicas already serving (issue #31:
    NIXL READs of a peer's committed copy, not a send of the trainers), and the ranks a
    scale-down removes leave at a refit boundary."""
    job = "fd-scale"
    cluster.namespace(NS)
    doc = _job(job, refits=60)
    doc["spec"]["rollout"]["replicas"] = 1
    doc["spec"]["weights"]["synthetic"]["pace"] = 0.2  # refits at a trainer's pace
    # Each step waits for every replica to serve, so the new ones join mid-job however
    # long their start takes (not a race with the job's end).
    doc["spec"]["weights"]["synthetic"]["lockstep"] = True
    cluster.kubectl.apply(doc)
    _refits(cluster, job, 2)
    policy = _started(cluster, job, "policy")
    cluster.kubectl.ok("scale", f"rj/{job}", "-n", NS, "--replicas=4")
    up = _serving(cluster, job, 4)
    assert _scale_of(cluster, job)["spec"]["replicas"] == 4
    # The selector the scale subresource hands an HPA finds the rollout pods, and no other.
    selector = _scale_of(cluster, job)["status"]["selector"]
    found = {p["metadata"]["labels"]["refit.dev/role"] for p in cluster.pods(NS, selector)}
    assert found == {"rollout"}, (selector, found)
    seeds = wait(
        lambda: (
            len(
                m := [e["message"] for e in _events(cluster, job) if e["reason"] == "ReplicaSeeded"]
            )
            >= 4
            and m
        ),
        f"{job}'s four replicas to say how they came to serve",
        timeout=120,
    )
    # The ledger (issue #32) lists the four replicas, each refit under the trainer's digest.
    four = wait(
        lambda: (s := cluster.job_status(NS, job)) and served_ranks(s) == [0, 1, 2, 3] and s,
        f"{job}'s ledger to list its four replicas",
        timeout=120,
    )
    for row in four["versions"]:
        assert row["digest"] == trainer_digest(doc["spec"], row["refit"]), four["versions"]
    cluster.kubectl.ok("scale", f"rj/{job}", "-n", NS, "--replicas=1")
    down = _serving(cluster, job, 1)
    status = _finished(cluster, job)
    assert status["phase"] == "Succeeded", status
    assert status["refitsCompleted"] == 60, status
    # The ranks the scale-down removed left the ledger; rank 0 serves the last refit.
    key = job_key(e["message"] for e in _events(cluster, job))
    ledger = [
        {"refit": 59, "digest": trainer_digest(doc["spec"], 59), "replicas": [0], "signedBy": key}
    ]
    assert status["versions"] == ledger, status["versions"]
    assert _started(cluster, job, "policy") == policy, "a scale recreated the policy pods"
    assert (status["epoch"], status["restarts"], status["preemptions"]) == (0, 0, 0), status
    for rank in (1, 2, 3):  # each new replica from a peer that served before it
        said = [m for m in seeds if m.startswith(f"rollout-{rank} (pod {job}-rollout-{rank}-")]
        assert len(said) == 1 and " seeded from rollout-" in said[0], (rank, seeds)
    records.record(
        "scale scenario",
        f"kubectl scale rj/{job} 1 -> 4 at refits {up['refitsCompleted']}, 4 -> 1 at "
        f"{down['refitsCompleted']}: Succeeded {status['refitsCompleted']}/60, policy uids "
        f"unchanged ({len(policy)}), epoch {status['epoch']}, restarts {status['restarts']}; "
        + "; ".join(m for m in seeds if not m.startswith("rollout-0 ")),
    )
    # The three ranks removed by the scale-down left at a refit boundary and exited 0.
    rollout = _started(cluster, job, "rollout")
    assert len(rollout) == 4, rollout  # rank 0 and the 3 the scale-up added
    removed = {uid: n for uid, n in rollout.items() if "-rollout-0-" not in n}
    for uid, name in removed.items():
        assert _exit_code(cluster, name, uid) == 0, name

    # An HPA on the RefitJob: accepted, and the HPA controller can read its scale.
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": job, "namespace": NS},
        "spec": {
            "scaleTargetRef": {"apiVersion": "refit.dev/v1alpha1", "kind": "RefitJob", "name": job},
            "minReplicas": 1,
            "maxReplicas": 4,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {
                        "name": "cpu",
                        "target": {"type": "Utilization", "averageUtilization": 80},
                    },
                }
            ],
        },
    }
    cluster.kubectl.apply(hpa)
    able = wait(
        lambda: next(
            (
                c
                for c in (
                    cluster.kubectl.json("get", "hpa", job, "-n", NS).get("status") or {}
                ).get("conditions")
                or []
                if c["type"] == "AbleToScale"
            ),
            None,
        ),
        "the HPA controller to look at the RefitJob's scale",
        timeout=120,
    )
    assert able["status"] == "True", able  # SucceededGetScale: the subresource answered
    cluster.kubectl.ok("delete", "hpa", job, "-n", NS)
    _delete(cluster, job)


def test_a_policy_pod_killed_mid_job_restarts_the_policy_gang_only(
    cluster: Cluster, install: Install
) -> None:
    job = "fd-kill-policy"
    cluster.namespace(NS)
    cluster.kubectl.apply(_job(job))
    before = _refits(cluster, job, 2)
    rollout = _started(cluster, job, "rollout")
    victim = _rank_pod(cluster, job, "policy", 0)
    _sigkill(cluster, victim)
    killed_at = time.monotonic()
    resumed = wait(
        lambda: (
            (s := cluster.job_status(NS, job)).get("epoch", 0) >= 1
            and s.get("refitsCompleted", 0) > before["refitsCompleted"]
            and s
        ),
        "a refit committed by the new policy epoch",
        timeout=240,
    )
    resumed_s = time.monotonic() - killed_at
    status = _finished(cluster, job)
    assert status["phase"] == "Succeeded", status
    assert status["refitsCompleted"] == REFITS, status
    # The rollout pods are the same pods, and each exited 0 having checked every refit.
    assert _started(cluster, job, "rollout") == rollout, "the rollout pods were recreated"
    assert status["rollout"]["replacements"] == 0, status
    records.record(
        "kill-policy scenario",
        f"{victim['metadata']['name']} SIGKILLed at refits {before['refitsCompleted']}/{REFITS};"
        f" epoch 1 committed refit {resumed['refitsCompleted']} {resumed_s:.1f} s after the "
        f"kill; Succeeded {status['refitsCompleted']}/{REFITS}, restarts {status['restarts']}, "
        f"rollout uids unchanged ({len(rollout)}), epochs 0..{status['epoch']}",
    )
    assert (status["epoch"], status["restarts"]) == (1, 1), status
    for uid, name in rollout.items():
        assert _exit_code(cluster, name, uid) == 0, name
    _delete(cluster, job)
