"""A user's session on the real control plane: ``kubectl apply -f examples/local.yaml``,
kube-scheduler places the gang on the process nodes, the workers rendezvous over the job's
ConfigMaps with their own ServiceAccount tokens and refit bit-exact over NIXL, and
``kubectl wait --for=condition=Complete`` returns.  Also: a job's first reconcile creates
its RoleBinding without the apiserver's 404 (issue #11: the Role and its RoleBinding were
created concurrently, and the escalation check looked the Role up too early).

Real: everything but the kubelet (process nodes) and the pod network (loopback).
"""

from __future__ import annotations

import time

import yaml
from tests.cluster.support import EXAMPLES, Cluster, Install, assert_bit_exact, example, wait

from refit_operator.api import names

NS = "demo"


def test_apply_example_then_wait_complete_bit_exact(cluster: Cluster, install: Install) -> None:
    cluster.namespace(NS)
    cluster.kubectl.ok("apply", "-n", NS, "-f", str(EXAMPLES / "local.yaml"))
    name = yaml.safe_load((EXAMPLES / "local.yaml").read_text())["metadata"]["name"]
    cluster.kubectl.ok(
        "wait", "--for=condition=Complete", f"rj/{name}", "-n", NS, "--timeout=300s", timeout=320
    )
    status = cluster.job_status(NS, name)
    assert status["phase"] == "Succeeded", status
    assert status["refitsCompleted"] == 3 and status["bytesTransferred"] > 0
    assert (status["restarts"], status["preemptions"]) == (0, 0)
    assert_bit_exact(cluster.gang_exit_codes(NS, name, 0), ranks=4)
    # Placed by kube-scheduler onto the process nodes (the operator sets no nodeName).
    assert set(cluster.gang(NS, name, 0).values()) <= set(cluster.nodes)
    table = cluster.kubectl.ok("get", "rj", "-n", NS)
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "PHASE", "POLICY", "ROLLOUT", "REFITS", "AGE"]
    assert row.split()[:5] == [name, "Succeeded", "0", "0", "3"], table
    wide = cluster.kubectl.ok("get", "rj", "-n", NS, "-o", "wide").splitlines()[0].split()
    assert wide == [
        "NAME",
        "PHASE",
        "POLICY",
        "ROLLOUT",
        "DESIRED",
        "REPLACED",
        "REFITS",
        "EPOCH",
        "AGE",
    ]
    assert install.operator.forbidden() == []
    cluster.kubectl.ok("delete", "rj", name, "-n", NS, "--wait=true", "--timeout=120s")


def test_first_reconcile_creates_every_child_without_a_404(
    cluster: Cluster, install: Install
) -> None:
    """Several jobs at once, as a team submits them: each job's first reconcile creates its
    ServiceAccount, Role, RoleBinding, Services, ConfigMap and gang in one round, with no
    HTTP 404 from the apiserver's RBAC escalation check and no kopf retry (~5 s later)."""
    cluster.namespace(NS)
    before = len(install.operator.text())
    jobs = []
    for index in range(4):
        job = example("local", metadata={"name": f"prompt-{index}", "namespace": NS})
        job["spec"]["transfer"]["refits"] = 1
        if index > 0:  # one gang runs; the others create theirs, which no node can take
            for role in ("policy", "rollout"):
                job["spec"][role]["template"] = {
                    "spec": {
                        "nodeSelector": {"refit.dev/test-no-such-node": "true"},
                        "containers": [{"name": "worker"}],
                    }
                }
        jobs.append(job)
    started = time.monotonic()
    cluster.kubectl.apply(jobs)
    bindings = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings"
    wait(
        lambda: (
            len(cluster.pods(NS, "refit.dev/job=prompt-0")) == 4
            and all(
                cluster.rest.find(f"{bindings}/{names.worker_account_name(f'prompt-{i}', role)}")
                for i in range(4)
                for role in ("policy", "rollout")
            )
        ),
        "every job's RoleBindings (one per role) and the running job's 4 pods after one reconcile",
        timeout=4.0,
    )
    took = time.monotonic() - started
    log = install.operator.text()[before:]
    # "HTTP 404" as kube.py and kopf say it; a bare "404" also matches a timestamp's ms.
    assert not any(s in log for s in ("HTTP 404", "status=404", "404 Not Found")), log
    assert "failed temporarily" not in log, log
    assert took < 4.0
    cluster.kubectl.ok(
        "wait", "--for=condition=Complete", "rj/prompt-0", "-n", NS, "--timeout=300s"
    )
    cluster.kubectl.ok("delete", "rj", "--all", "-n", NS, "--wait=true", "--timeout=120s")
