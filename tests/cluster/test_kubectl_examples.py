"""Every RefitJob under ``examples/`` as a user applies it to a real cluster: ``kubectl
apply`` (validated against the apiserver's OpenAPI and the CRD, no ``--validate=false``),
``kubectl get`` of its children (each owned by the job, labelled, with the preemption signal
injected), ``kubectl wait`` on its phase, and ``kubectl delete`` that takes the children
with it through the garbage collector.

The process nodes are cordoned for this test: the gangs stay Pending (a GPU example cannot
run here, a 1 GiB benchmark should not), which is what a user sees before nodes free up.
``examples/local.yaml`` runs to completion in ``test_refit.py``.

Real: kubectl, the apiserver's validation, kube-scheduler (which leaves the pods
unscheduled), the garbage collector, the operator.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.cluster.support import EXAMPLES, Cluster, Install, wait

from refit_operator.api import names


def example_files() -> list[Path]:
    """Every manifest under ``examples/`` whose documents include a RefitJob."""
    return [
        path
        for path in sorted(EXAMPLES.glob("*.yaml"))
        if any(d and d.get("kind") == "RefitJob" for d in yaml.safe_load_all(path.read_text()))
    ]


@pytest.fixture()
def cordoned(cluster: Cluster) -> Iterator[None]:
    for node in cluster.nodes:
        cluster.kubectl.ok("cordon", node)
    try:
        yield
    finally:
        for node in cluster.nodes:
            cluster.kubectl.ok("uncordon", node)


def _job(path: Path) -> dict[str, Any]:
    (job,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "RefitJob"]
    return dict(job)


def test_there_are_examples() -> None:
    assert {p.name for p in example_files()} >= {"local.yaml", "cluster-gpu.yaml"}


@pytest.mark.parametrize("path", example_files(), ids=lambda p: p.name)
def test_apply_get_wait_delete(
    cluster: Cluster, install: Install, cordoned: None, path: Path
) -> None:
    job = _job(path)
    name = job["metadata"]["name"]
    namespace = cluster.namespace(job["metadata"].get("namespace") or f"ex-{name}")
    out = cluster.kubectl.ok("apply", "-n", namespace, "-f", str(path))
    assert f"refitjob.refit.dev/{name} created" in out
    if job["spec"].get("suspend"):
        # Queued (examples/cluster-gpu.yaml): admitted the way its comment says.
        cluster.kubectl.ok(
            "wait",
            f"refitjobs/{name}",
            "-n",
            namespace,
            "--for=jsonpath={.status.phase}=Suspended",
            "--timeout=30s",
        )
        patch = '{"spec":{"suspend":false}}'
        cluster.kubectl.ok("patch", "rj", name, "-n", namespace, "--type=merge", "-p", patch)
    policy, rollout = (int(job["spec"][r].get("replicas", 1)) for r in ("policy", "rollout"))
    # A job created suspended is resumed in epoch 1 (its rollout slots never had a pod,
    # so they stay at generation 0).
    epoch = 1 if job["spec"].get("suspend") else 0
    wanted = sorted(
        [f"{name}-policy-{i}-e{epoch}" for i in range(policy)]
        + [f"{name}-rollout-{i}-g0" for i in range(rollout)]
    )
    selector = f"refit.dev/job={name}"
    wait(
        lambda: len(cluster.pods(namespace, selector)) == len(wanted),
        f"the {len(wanted)} pods of {name}",
        timeout=30,
    )
    items = cluster.kubectl.json("get", "pods,svc,cm", "-n", namespace, "-l", selector)["items"]
    by_kind: dict[str, list[str]] = {}
    for item in items:
        by_kind.setdefault(item["kind"], []).append(item["metadata"]["name"])
        (owner,) = item["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("RefitJob", name, True)
    assert sorted(by_kind["Pod"]) == wanted
    assert sorted(by_kind["Service"]) == [f"{name}-policy", f"{name}-rollout"]
    assert set(names.rendezvous_maps(name, policy, rollout)) <= set(by_kind["ConfigMap"])
    for pod in cluster.pods(namespace, selector):
        assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
        labels = pod["metadata"]["labels"]
        assert {"refit.dev/role", "refit.dev/rank", "refit.dev/epoch"} <= set(labels)
        lifecycle = pod["spec"]["containers"][0]["lifecycle"]
        assert lifecycle.get("preStop") or lifecycle.get("stopSignal"), lifecycle
    cluster.kubectl.ok(
        "wait",
        f"refitjobs/{name}",
        "-n",
        namespace,
        "--for=jsonpath={.status.phase}=Pending",
        "--timeout=30s",
    )
    cluster.kubectl.ok("delete", "-n", namespace, "-f", str(path), "--wait", "--timeout=60s")
    wait(
        lambda: (
            not cluster.kubectl.json("get", "pods,svc,cm", "-n", namespace, "-l", selector)["items"]
        ),
        f"the garbage collector to take the children of {name}",
        timeout=60,
    )
    gone = cluster.kubectl.run("get", f"refitjobs/{name}", "-n", namespace)
    assert gone.returncode != 0 and "NotFound" in gone.stderr
