"""The operator end to end against the API emulator: kopf in the test's loop, real HTTP.

Real: kopf, our handlers/controller/client, aiohttp, the kubeconfig loader.  Emulated: the
API server (``tests/emulator``); no kubelet, so the test writes pod status as one would.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.emulator import ApiEmulator
from tests.integration.support import (
    JOBS,
    NS,
    PODS,
    OperatorRun,
    eventually,
    load_job,
    set_pod_phase,
)
from tests.support.reports import reports

from refit_worker.contract.rendezvous import (
    BARRIER_KEY,
    BarrierEntry,
    MetadataEntry,
    decode_entry,
    encode_entry,
    meta_key,
)

POD_NAMES = ["demo-policy-0", "demo-policy-1", "demo-rollout-0", "demo-rollout-1"]
CHILDREN = {
    "v1/services": ["demo-policy", "demo-rollout"],
    "v1/configmaps": ["demo-rendezvous"],
    "v1/serviceaccounts": ["demo-worker"],
    "rbac.authorization.k8s.io/v1/roles": ["demo-worker"],
    "rbac.authorization.k8s.io/v1/rolebindings": ["demo-worker"],
    PODS: POD_NAMES,
}


def _names(api: ApiEmulator, resource: str) -> list[str]:
    return sorted(o["metadata"]["name"] for o in api.list(resource, NS))


def _status(api: ApiEmulator, name: str = "demo") -> dict[str, Any]:
    return api.get(JOBS, NS, name).get("status") or {}


def _events(api: ApiEmulator, name: str = "demo") -> list[tuple[str, str]]:
    return [
        (e["reason"], e["message"])
        for e in api.list("v1/events", NS)
        if e["involvedObject"]["name"] == name
    ]


async def _all_pods(api: ApiEmulator, epoch: int) -> list[dict[str, Any]]:
    def check() -> list[dict[str, Any]] | None:
        pods = api.list(PODS, NS)
        epochs = {p["metadata"]["labels"]["refit.dev/epoch"] for p in pods}
        return pods if len(pods) == 4 and epochs == {str(epoch)} else None

    result: list[dict[str, Any]] = await eventually(check, f"4 pods of epoch {epoch}")
    return result


async def _phase(api: ApiEmulator, phase: str, name: str = "demo") -> dict[str, Any]:
    status: dict[str, Any] = await eventually(
        lambda: _status(api, name) if _status(api, name).get("phase") == phase else None,
        f"phase {phase} of {name} (now {_status(api, name).get('phase')})",
    )
    return status


async def test_apply_creates_every_child_owned_labelled_and_injected(
    kube_emulator: ApiEmulator, operator: OperatorRun
) -> None:
    job = kube_emulator.create(JOBS, NS, load_job())
    await _all_pods(kube_emulator, 0)
    await eventually(
        lambda: all(_names(kube_emulator, r) == n for r, n in CHILDREN.items()), "all children"
    )
    uid = job["metadata"]["uid"]
    for resource in CHILDREN:
        for obj in kube_emulator.list(resource, NS):
            (owner,) = obj["metadata"]["ownerReferences"]
            assert (owner["uid"], owner["kind"], owner["controller"]) == (uid, "RefitJob", True)
            assert obj["metadata"]["labels"]["refit.dev/job"] == "demo"
    pod = kube_emulator.get(PODS, NS, "demo-rollout-1")
    labels = pod["metadata"]["labels"]
    assert (labels["refit.dev/role"], labels["refit.dev/rank"], labels["refit.dev/epoch"]) == (
        "rollout",
        "1",
        "0",
    )
    container = pod["spec"]["containers"][0]
    assert container["lifecycle"] == {"stopSignal": "SIGUSR1"}
    assert pod["spec"]["os"] == {"name": "linux"}
    assert pod["spec"]["terminationGracePeriodSeconds"] == 40
    assert pod["spec"]["restartPolicy"] == "Never"
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["REFIT_ROLE"] == "rollout" and env["REFIT_RANK"] == "1"
    assert env["REFIT_PREEMPTION_SIGNAL"] == "SIGUSR1"
    assert env["REFIT_POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    status = await _phase(kube_emulator, "Pending")
    assert status["policy"] == {"ready": 0, "total": 2}
    assert status["observedGeneration"] == 1


async def test_phases_follow_the_pods_to_success(
    kube_emulator: ApiEmulator, operator: OperatorRun
) -> None:
    kube_emulator.create(JOBS, NS, load_job())
    await _all_pods(kube_emulator, 0)
    for name in POD_NAMES:
        set_pod_phase(kube_emulator, name, "Running")
    status = await _phase(kube_emulator, "Running")
    assert status["policy"] == {"ready": 2, "total": 2}
    assert status["rollout"] == {"ready": 2, "total": 2}
    # As workers would: every rank reports its refits done, then its pod exits 0.
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in kube_emulator.list(PODS, NS)}
    data = reports(uids, refits=2)
    kube_emulator.patch("v1/configmaps", NS, "demo-rendezvous", {"data": data})
    for name in POD_NAMES:
        set_pod_phase(kube_emulator, name, "Succeeded")
    status = await _phase(kube_emulator, "Succeeded")
    assert status["refitsCompleted"] == 2 and status["completionTime"]
    assert status["bytesTransferred"] == 4000 and status["verification"] == "checksums"
    # The finished pods stay for their logs.
    assert _names(kube_emulator, PODS) == POD_NAMES
    await eventually(
        lambda: {"Running", "Succeeded"} <= {r for r, _ in _events(kube_emulator)},
        "Running and Succeeded events",
    )


async def test_disruption_target_restarts_the_gang_as_a_preemption(
    kube_emulator: ApiEmulator, operator: OperatorRun
) -> None:
    kube_emulator.create(JOBS, NS, load_job())
    first = {p["metadata"]["name"]: p["metadata"]["uid"] for p in await _all_pods(kube_emulator, 0)}
    for name in POD_NAMES:
        set_pod_phase(kube_emulator, name, "Running")
    await _phase(kube_emulator, "Running")
    kube_emulator.patch(
        "v1/configmaps", NS, "demo-rendezvous", {"data": {"meta.policy.0": '{"epoch":0}'}}
    )
    set_pod_phase(
        kube_emulator,
        "demo-policy-1",
        "Running",
        conditions=[
            {"type": "Ready", "status": "True"},
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"},
        ],
    )
    second = await _all_pods(kube_emulator, 1)
    assert all(first[p["metadata"]["name"]] != p["metadata"]["uid"] for p in second)
    status = await _phase(kube_emulator, "Pending")
    assert (status["epoch"], status["preemptions"], status["restarts"]) == (1, 1, 0)
    assert kube_emulator.get("v1/configmaps", NS, "demo-rendezvous").get("data", {}) == {}
    preempted = await eventually(
        lambda: [m for r, m in _events(kube_emulator) if r == "Preempted"], "a Preempted event"
    )
    assert len(preempted) == 1 and "EvictionByEvictionAPI" in preempted[0]


async def test_failures_restart_until_max_restarts_then_fail(
    kube_emulator: ApiEmulator, operator: OperatorRun
) -> None:
    kube_emulator.create(JOBS, NS, load_job())  # maxRestarts: 1
    await _all_pods(kube_emulator, 0)
    exit_1 = [{"name": "worker", "state": {"terminated": {"exitCode": 1}}}]
    set_pod_phase(kube_emulator, "demo-rollout-0", "Failed", containerStatuses=exit_1)
    await _all_pods(kube_emulator, 1)
    status = await _phase(kube_emulator, "Pending")
    assert (status["restarts"], status["preemptions"], status["epoch"]) == (1, 0, 1)
    set_pod_phase(kube_emulator, "demo-policy-0", "Failed", containerStatuses=exit_1)
    status = await _phase(kube_emulator, "Failed")
    assert status["restarts"] == 1
    assert "demo-policy-0 failed: exit code 1; maxRestarts (1) used up" in status["message"]
    await eventually(lambda: not kube_emulator.list(PODS, NS), "the failed gang's pods deleted")
    await eventually(lambda: "Failed" in [r for r, _ in _events(kube_emulator)], "Failed event")


@pytest.mark.parametrize(
    ("spec_change", "message"),
    [
        ({"preemption": {"signal": "SIGWHAT"}}, "unknown signal name 'SIGWHAT'"),
        ({"transfer": {"bucketSize": "0"}}, "bucketSize '0' must be more than 0 bytes"),
        ({"policy": {"replicas": 0}}, "spec.policy.replicas: Input should be greater than"),
        ({"colour": "blue"}, "spec.colour: Extra inputs are not permitted"),
    ],
)
async def test_invalid_manifest_fails_with_message_and_event_and_no_children(
    kube_emulator: ApiEmulator, operator: OperatorRun, spec_change: dict[str, Any], message: str
) -> None:
    kube_emulator.create(JOBS, NS, load_job("bad", **spec_change))
    status = await _phase(kube_emulator, "Failed", "bad")
    assert message in status["message"]
    await eventually(
        lambda: any(r == "InvalidSpec" and message in m for r, m in _events(kube_emulator, "bad")),
        "an InvalidSpec event",
    )
    for resource in CHILDREN:
        assert kube_emulator.list(resource, NS) == [], resource


async def test_delete_removes_every_child(
    kube_emulator: ApiEmulator, operator: OperatorRun
) -> None:
    kube_emulator.create(JOBS, NS, load_job())
    await _all_pods(kube_emulator, 0)
    await eventually(lambda: _names(kube_emulator, "v1/configmaps"), "the rendezvous map")
    assert "refit.dev/finalizer" in kube_emulator.get(JOBS, NS, "demo")["metadata"]["finalizers"]
    kube_emulator.delete(JOBS, NS, "demo")
    await eventually(lambda: kube_emulator.find(JOBS, NS, "demo") is None, "the job gone")
    for resource in CHILDREN:
        assert kube_emulator.list(resource, NS) == [], resource


async def test_operator_restart_mid_job_creates_no_duplicates(
    kube_emulator: ApiEmulator, operator: OperatorRun
) -> None:
    kube_emulator.create(JOBS, NS, load_job())
    before = {
        p["metadata"]["name"]: p["metadata"]["uid"] for p in await _all_pods(kube_emulator, 0)
    }
    for name in POD_NAMES[:2]:
        set_pod_phase(kube_emulator, name, "Running")
    await eventually(lambda: _status(kube_emulator).get("policy", {}).get("ready") == 2, "2 ready")
    await operator.stop()
    for name in POD_NAMES[2:]:
        set_pod_phase(kube_emulator, name, "Running")  # happens while no operator runs
    await operator.start()
    status = await _phase(kube_emulator, "Running")
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in kube_emulator.list(PODS, NS)}
    assert after == before
    assert (status["epoch"], status["restarts"], status["preemptions"]) == (0, 0, 0)
    for resource, names in CHILDREN.items():
        assert _names(kube_emulator, resource) == names


async def test_suspend_deletes_pods_keeps_the_job_and_resumes(
    kube_emulator: ApiEmulator, operator: OperatorRun
) -> None:
    kube_emulator.create(JOBS, NS, load_job())
    await _all_pods(kube_emulator, 0)
    kube_emulator.patch(JOBS, NS, "demo", {"spec": {"suspend": True}})
    status = await _phase(kube_emulator, "Suspended")
    await eventually(lambda: not kube_emulator.list(PODS, NS), "pods deleted on suspend")
    assert _names(kube_emulator, "v1/configmaps") == ["demo-rendezvous"]  # the job's rest stays
    assert (status["restarts"], status["preemptions"]) == (0, 0)
    kube_emulator.patch(JOBS, NS, "demo", {"spec": {"suspend": False}})
    await _all_pods(kube_emulator, 1)
    status = await _phase(kube_emulator, "Pending")
    assert (status["epoch"], status["restarts"], status["preemptions"]) == (1, 0, 0)


async def test_scaling_the_spec_recreates_the_gang_without_counting_it(
    kube_emulator: ApiEmulator, operator: OperatorRun
) -> None:
    kube_emulator.create(JOBS, NS, load_job())
    await _all_pods(kube_emulator, 0)
    kube_emulator.patch(JOBS, NS, "demo", {"spec": {"rollout": {"replicas": 3}}})
    await eventually(
        lambda: len(kube_emulator.list(PODS, NS, "refit.dev/epoch=1")) == 5, "5 pods of epoch 1"
    )
    status = await _phase(kube_emulator, "Pending")
    assert (status["epoch"], status["restarts"], status["preemptions"]) == (1, 0, 0)
    assert status["rollout"]["total"] == 3 and status["observedGeneration"] == 2


async def test_barrier_opens_when_every_pod_published(
    kube_emulator: ApiEmulator, operator: OperatorRun
) -> None:
    kube_emulator.create(JOBS, NS, load_job())
    pods = await _all_pods(kube_emulator, 0)
    for pod in pods:  # what each worker does: a merge patch of its own key
        labels, uid = pod["metadata"]["labels"], pod["metadata"]["uid"]
        role, rank = labels["refit.dev/role"], int(labels["refit.dev/rank"])
        key = meta_key(role, rank)
        value = encode_entry(
            key, MetadataEntry(epoch=0, uid=uid, role=role, rank=rank, agent='{"a": 1}')
        )
        kube_emulator.patch("v1/configmaps", NS, "demo-rendezvous", {"data": {key: value}})

    def barrier() -> str | None:
        data = kube_emulator.get("v1/configmaps", NS, "demo-rendezvous").get("data") or {}
        return data.get(BARRIER_KEY)

    entry = decode_entry(BARRIER_KEY, await eventually(barrier, "the barrier of epoch 0"))
    assert isinstance(entry, BarrierEntry) and entry.epoch == 0
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
    assert entry.policy_uids == (uids["demo-policy-0"], uids["demo-policy-1"])
