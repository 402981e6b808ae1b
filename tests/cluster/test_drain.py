"""``kubectl drain`` mid-refit on the real control plane, two process nodes.

First with a PodDisruptionBudget that allows no disruption: the eviction API refuses
(HTTP 429), the drain gives up, and the job carries on untouched (no preemption).  Then
without it: the eviction API marks the pods ``DisruptionTarget`` and deletes them with
their grace period, the evicted workers stop at a bucket boundary (exit 83), and each
role's failure domain answers: an evicted policy pod restarts the policy gang (a
preemption, a new epoch), an evicted rollout pod is replaced alone; kube-scheduler places
the new pods on the node left, and every refit is committed bit-exact.  The figures are
printed at the end of the session.

Real: the eviction API, kube-controller-manager's disruption controller, kube-scheduler,
kubectl drain (no ``--force``), the operator, the workers.
"""

from __future__ import annotations

from typing import Any

from tests.cluster import records
from tests.cluster.support import Cluster, Install, assert_bit_exact, example, wait

NS = "drain"
JOB = "drain-demo"
REFITS = 30


def _job() -> dict[str, Any]:
    job = example("local", metadata={"name": JOB, "namespace": NS})
    job["spec"]["transfer"]["refits"] = REFITS
    return job


def _pdb() -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "no-disruption", "namespace": NS},
        # minAvailable as a number: the disruption controller cannot scale a RefitJob, so
        # maxUnavailable or a percentage would leave the budget unsynced (SyncFailed).
        "spec": {"minAvailable": 4, "selector": {"matchLabels": {"refit.dev/job": JOB}}},
    }


def _budget(cluster: Cluster) -> dict[str, Any]:
    found = cluster.rest.find(f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/no-disruption")
    return dict((found or {}).get("status") or {})


def test_drain_mid_refit_moves_the_evicted_pods_to_the_other_node(
    cluster: Cluster, install: Install
) -> None:
    cluster.namespace(NS)
    cluster.kubectl.apply(_pdb())
    cluster.kubectl.apply(_job())
    wait(
        lambda: (
            _budget(cluster).get("currentHealthy") == 4
            and _budget(cluster).get("disruptionsAllowed") == 0
        ),
        "the disruption controller to count the running gang under the PDB",
        timeout=120,
    )
    epoch0 = {p["metadata"]["uid"]: p for p in cluster.pods(NS, f"refit.dev/job={JOB}")}
    victim = next(iter(epoch0.values()))["spec"]["nodeName"]
    other = next(n for n in cluster.nodes if n != victim)
    try:
        # A PDB that allows no disruption: the eviction is refused, the drain times out.
        blocked = cluster.kubectl.run(
            "drain", victim, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=5s"
        )
        assert blocked.returncode != 0
        assert "disruption budget" in blocked.stderr + blocked.stdout, blocked.stderr
        assert cluster.job_status(NS, JOB)["preemptions"] == 0
        now = {p["metadata"]["uid"] for p in cluster.pods(NS, f"refit.dev/job={JOB}")}
        assert now == set(epoch0), "a pod went although the budget allowed no disruption"

        cluster.kubectl.ok("delete", "pdb", "no-disruption", "-n", NS)
        wait(
            lambda: cluster.job_status(NS, JOB).get("refitsCompleted", 0) >= 1,
            "the first refit",
            timeout=180,
        )
        done_before = cluster.job_status(NS, JOB)["refitsCompleted"]
        assert done_before < REFITS, "the job finished before the drain; raise REFITS"
        cluster.kubectl.ok(
            "drain",
            victim,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--timeout=120s",
            timeout=150,
        )
        status = wait(
            lambda: (
                (s := cluster.job_status(NS, JOB)).get("phase") in ("Succeeded", "Failed") and s
            ),
            "the job to finish after the drain",
            timeout=300,
        )
    finally:
        cluster.kubectl.ok("uncordon", victim)
    assert status["phase"] == "Succeeded", status
    assert status["restarts"] == 0, status
    assert status["refitsCompleted"] == REFITS
    evicted = {u: p for u, p in epoch0.items() if p["spec"]["nodeName"] == victim}
    roles = {p["metadata"]["labels"]["refit.dev/role"] for p in evicted.values()}
    # The evicted pods carried the eviction's condition when their node deleted them, and
    # each stopped on its own at a safe point (83): none was killed (137) or failed (1).
    codes = cluster.exit_codes()
    for uid, pod in evicted.items():
        conditions = {c["type"]: c for c in cluster.nodes[victim].final_conditions[uid]}
        assert conditions["DisruptionTarget"]["reason"] == "EvictionByEvictionAPI"
        assert codes.get((pod["metadata"]["name"], uid)) == 83, (pod["metadata"]["name"], codes)
    # Per-role failure domains: an evicted policy pod restarts the policy gang (a
    # preemption, a new epoch); an evicted rollout pod is replaced alone.
    if "policy" in roles:
        assert status["preemptions"] >= 1 and status["epoch"] >= 1, status
    else:
        assert status["preemptions"] == 0 and status["epoch"] == 0, status
    rollout_evicted = sum(
        p["metadata"]["labels"]["refit.dev/role"] == "rollout" for p in evicted.values()
    )
    assert status["rollout"]["replacements"] >= rollout_evicted, status
    # Every pod started after the drain ran on the node left; the ranks that ran last in
    # each slot checked every refit bit for bit (a rollout rank exits 0 only then).
    later = {
        (name, uid): node.name
        for node in cluster.nodes.values()
        for ns, name, uid, labels in node.started
        if ns == NS and labels.get("refit.dev/job") == JOB and uid not in epoch0
    }
    assert later and set(later.values()) == {other}, later
    last = {
        p["metadata"]["name"]: p["metadata"]["uid"]
        for p in cluster.pods(NS, f"refit.dev/job={JOB}")
    }
    ended = wait(
        lambda: all(k in cluster.exit_codes() for k in last.items()) and cluster.exit_codes(),
        "every pod of the finished job to exit",
        timeout=60,
    )
    final = {name: ended[(name, uid)] for name, uid in last.items()}
    assert_bit_exact(final, ranks=len(last))
    nodes0 = sorted({p["spec"]["nodeName"] for p in epoch0.values()})
    records.record(
        "drain scenario",
        f"refits {status['refitsCompleted']}/{REFITS} (bit-exact: last pods' exit codes "
        f"{sorted(final.items())}), "
        f"{done_before} done before the drain of {victim} (held {sorted(roles)} pods); "
        f"preemptions {status['preemptions']}, restarts {status['restarts']}, rollout "
        f"replacements {status['rollout']['replacements']}, epochs 0..{status['epoch']}; "
        f"nodes used: before {nodes0}, after [{other}]; "
        f"PDB minAvailable=4 of 4: drain refused, 0 preemptions",
    )
    cluster.kubectl.ok("delete", "rj", JOB, "-n", NS, "--wait=true", "--timeout=120s")
