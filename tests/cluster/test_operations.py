"""Operating the operator on the real control plane: two replicas with leader election,
the leader SIGKILLed mid-job, metrics that match the status, and a delete with no
operator running.

Two ``refit operator --leader-elect`` processes run on the chart's ServiceAccount token
(so the chart's Lease Role is what they use).  The first leads; the second is a ready
standby that reconciles nothing.  Mid-job, a scrape of the leader's ``/metrics`` shows the
refits and bytes of ``status``; then the leader is killed with SIGKILL (no clean stop, no
release), the standby takes the Lease within a lease duration (plus a retry period), and
the job completes with every child created once.  The new leader's metrics continue the
same counters.  When another holder writes itself into the Lease, the leader exits at
once (code 3); restarted, it waits as a standby until that Lease expires, leads, and,
stopped with SIGTERM, gives the Lease up.  Finally, with no operator
running, the job is deleted at once (no finalizer) and the garbage collector takes its
children.

Real: kube-apiserver (Lease preconditions, RBAC), kube-controller-manager (GC), the
operator processes, the workers, HTTP scrapes parsed by prometheus_client's parser.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.cluster import records
from tests.cluster.support import (
    CHILD_KINDS,
    OPERATOR_NAMESPACE,
    ChildWatch,
    Cluster,
    Install,
    OperatorProcess,
    elapsed,
    example,
    install_chart,
    uninstall_chart,
    wait,
)

#: ``refit_operator.shell.runtime.EXIT_LEASE_LOST`` (not imported: the operator is a process here).
EXIT_LEASE_LOST = 3
NS = "operations"
RELEASE = "ha"
LEASE = f"{RELEASE}-refit-operator"  # the chart's --leader-election-id
LEASE_S, RENEW_S, RETRY_S = 4.0, 3.0, 1.0
REFITS = 12


@pytest.fixture(scope="module")
def release(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Install]:
    installed = install_chart(cluster, RELEASE, tmp_path_factory.mktemp("ha"), start=False)
    try:
        yield installed
    finally:
        uninstall_chart(cluster, installed)


def _replica(install: Install, name: str, tmp: Path) -> OperatorProcess:
    return OperatorProcess(
        install.kubeconfig,
        tmp / f"{name}.log",
        "--leader-elect",
        f"--leader-election-namespace={OPERATOR_NAMESPACE}",
        f"--leader-election-id={LEASE}",
        f"--leader-elect-lease-duration={LEASE_S}",
        f"--leader-elect-renew-deadline={RENEW_S}",
        f"--leader-elect-retry-period={RETRY_S}",
        env={"POD_NAME": name},
    )


def _holder(cluster: Cluster) -> str:
    lease = cluster.rest.find(
        f"/apis/coordination.k8s.io/v1/namespaces/{OPERATOR_NAMESPACE}/leases/{LEASE}"
    )
    return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")


def _steal(cluster: Cluster) -> None:
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    spec = {"holderIdentity": "intruder", "renewTime": stamp, "acquireTime": stamp}
    cluster.kubectl.ok(
        "patch",
        "lease",
        LEASE,
        "-n",
        OPERATOR_NAMESPACE,
        "--type=merge",
        "-p",
        json.dumps({"spec": spec}),
    )


def _scrape(operator: OperatorProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(operator.get("/metrics"))
        for s in family.samples
    }


def _metrics_match_status(cluster: Cluster, operator: OperatorProcess, job: str) -> dict[str, int]:
    """A scrape between two equal status reads shows the same refits and bytes; returns
    them.  (Refits land every second or so: a changed status between the reads is retried.)"""

    def consistent() -> dict[str, int] | None:
        before = cluster.job_status(NS, job)
        samples = _scrape(operator)
        after = cluster.job_status(NS, job)
        figures = ("refitsCompleted", "bytesTransferred")
        if [before.get(f) for f in figures] != [after.get(f) for f in figures]:
            return None
        labels = (("job", job), ("namespace", NS))
        assert samples[("refit_job_refits_total", labels)] == after["refitsCompleted"]
        assert samples[("refit_job_transferred_bytes_total", labels)] == after["bytesTransferred"]
        assert samples[("refit_job_preemptions_total", labels)] == after["preemptions"]
        return {f: int(after[f]) for f in figures}

    result: dict[str, int] = wait(consistent, "a scrape between two equal status reads", 30)
    return result


def test_standby_takes_over_a_killed_leader_and_the_job_completes_once(
    cluster: Cluster, release: Install, tmp_path: Path
) -> None:
    cluster.namespace(NS)
    first, second = _replica(release, "op-a", tmp_path), _replica(release, "op-b", tmp_path)
    first.start()  # ready: it leads and has listed the RefitJobs
    second.start()  # ready too: a standby that reaches the API
    try:
        assert _holder(cluster).startswith("op-a_")
        assert _scrape(first)[("refit_operator_leader", ())] == 1
        assert _scrape(second)[("refit_operator_leader", ())] == 0
        job = example("local", metadata={"name": "ha-job", "namespace": NS})
        job["spec"]["transfer"]["refits"] = REFITS
        with ChildWatch(cluster, NS, "ha-job").running() as watch:
            cluster.kubectl.apply(job)
            wait(
                lambda: cluster.job_status(NS, "ha-job").get("refitsCompleted", 0) >= 2,
                "two refits under the first leader",
                timeout=180,
            )
            seen = _metrics_match_status(cluster, first, "ha-job")
            assert seen["refitsCompleted"] >= 2 and seen["bytesTransferred"] > 0
            rollout = _scrape(first)[("refit_refit_duration_seconds_count", (("role", "rollout"),))]
            # Each rollout rank's itemised refits, each observed once.
            assert rollout >= 2 * seen["refitsCompleted"], rollout
            # The standby never reconciled anything, nor exports any job.
            standby = _scrape(second)
            assert standby[("refit_operator_reconcile_duration_seconds_count", ())] == 0
            assert not any(name.startswith("refit_job_") for name, _ in standby)

            killed_at = time.monotonic()
            assert first.kill() == -9
            wait(lambda: _holder(cluster).startswith("op-b_"), "the standby to lead", 30)
            takeover = elapsed(killed_at)
            # Within the lease, counted from the last renewal it saw, plus its retry.
            assert takeover <= LEASE_S + 2 * RETRY_S + 2.0, takeover
            records.LINES.append(
                ("leader SIGKILLed mid-job", f"standby took the Lease after {takeover} s")
            )
            status = wait(
                lambda: (s := cluster.job_status(NS, "ha-job")).get("phase") == "Succeeded" and s,
                "the job to finish under the new leader",
                timeout=240,
            )
        assert status["refitsCompleted"] == REFITS, status
        assert (status["epoch"], status["restarts"], status["preemptions"]) == (0, 0, 0)
        for kind in CHILD_KINDS:
            assert all(len(uids) == 1 for uids in watch.uids(kind).values()), watch.uids(kind)
        assert len(watch.uids("pods")) == 4
        assert watch.refits == sorted(watch.refits), "refitsCompleted went backwards"
        # The new leader's counters continue the job's own, as its status says.
        assert _metrics_match_status(cluster, second, "ha-job")["refitsCompleted"] == REFITS
        assert second.answers("/readyz")
        assert second.forbidden() == []

        # Another holder writes itself into the Lease (as after a partition that outlived
        # the lease): the leader sees it at its next renewal and exits at once.
        stolen_at = time.monotonic()
        _steal(cluster)
        assert second.process is not None
        assert second.process.wait(RENEW_S + 5) == EXIT_LEASE_LOST
        records.LINES.append(("Lease taken away", f"leader exited after {elapsed(stolen_at)} s"))
        assert "leader election lost" in second.text()
        # Restarted (as its Deployment would), it is a standby until the intruder's Lease
        # expires, then leads; SIGTERM then gives the Lease up on the way out.
        second.start()
        assert _holder(cluster) == "intruder"
        wait(lambda: _holder(cluster).startswith("op-b_"), "the restarted replica to lead", 30)
        assert second.stop() == 0
        assert _holder(cluster) == ""
    finally:
        first.stop()
        second.stop()

    # No operator runs: the delete does not wait for one, the GC removes the children.
    assert not cluster.kubectl.json("get", "rj", "ha-job", "-n", NS)["metadata"].get("finalizers")
    cluster.kubectl.ok("delete", "rj", "ha-job", "-n", NS, "--wait=true", "--timeout=30s")
    wait(lambda: not any(watch.children().values()), "the GC to delete the children", 120)
