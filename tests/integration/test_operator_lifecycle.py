"""The operator against the API emulator, for what a real apiserver cannot be made to show:
a RefitJob the CRD would refuse (an older or hand-edited CRD lets it through; the operator
still refuses it, with a message and an Event, and creates nothing), and the barrier
opening exactly when every rank's metadata entry (written here by the test, as the workers
would) is in.  Everything else the operator does with the API -- children, phases,
preemption, failures, suspend, spec edits, restarts, cascading delete -- is proven against
the real control plane in ``tests/cluster``.

Real: kopf, our handlers/controller/client, aiohttp, the kubeconfig loader.  Emulated: the
API server (``tests/emulator``).
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.emulator import ApiEmulator
from tests.support.operator_run import (
    JOBS,
    NS,
    PODS,
    OperatorRun,
    eventually,
    load_job,
)
from tests.support.rendezvous_maps import spread

from refit_operator.api import names
from refit_worker.contract.rendezvous import (
    BARRIER_KEY,
    BarrierEntry,
    MetadataEntry,
    decode_entry,
    encode_entry,
    meta_key,
)

POD_NAMES = ["demo-policy-0-e0", "demo-policy-1-e0", "demo-rollout-0-g0", "demo-rollout-1-g0"]
CHILDREN = {
    "v1/services": ["demo-policy", "demo-rollout"],
    # The operator's map and each role's (the job has 2 + 2 ranks).
    "v1/configmaps": names.rendezvous_maps("demo", 2, 2),
    "v1/serviceaccounts": [names.worker_account_name("demo", r) for r in ("policy", "rollout")],
    "rbac.authorization.k8s.io/v1/roles": [
        names.worker_account_name("demo", r) for r in ("policy", "rollout")
    ],
    "rbac.authorization.k8s.io/v1/rolebindings": [
        names.worker_account_name("demo", r) for r in ("policy", "rollout")
    ],
    "v1/secrets": [names.signing_secret_name("demo")],
    PODS: POD_NAMES,
}


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


@pytest.mark.parametrize(
    ("spec_change", "message"),
    [
        ({"preemption": {"signal": "SIGWHAT"}}, "Unknown signal name 'SIGWHAT'"),
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


async def test_barrier_opens_when_every_pod_published(
    kube_emulator: ApiEmulator, operator: OperatorRun
) -> None:
    kube_emulator.create(JOBS, NS, load_job())
    pods = await _all_pods(kube_emulator, 0)
    for pod in pods:  # what each worker does: a merge patch of its own key
        # A worker publishes from a running container: its kubelet reports Running first
        # (a pod not running holds no rollout slot, whatever it published).
        running = {"status": {"phase": "Running"}}
        kube_emulator.patch("v1/pods", NS, pod["metadata"]["name"], running, status=True)
        labels, uid = pod["metadata"]["labels"], pod["metadata"]["uid"]
        role, rank = labels["refit.dev/role"], int(labels["refit.dev/rank"])
        key = meta_key(role, rank)
        value = encode_entry(
            key, MetadataEntry(epoch=0, uid=uid, role=role, rank=rank, agent='{"a": 1}')
        )
        # Into the map of its role (the only one its pod may patch).
        name = names.rendezvous_name("demo", role)
        assert spread("demo", {key: value})[name] == {key: value}
        kube_emulator.patch("v1/configmaps", NS, name, {"data": {key: value}})

    def barrier() -> str | None:
        # The operator's map, which holds the barrier and no rank's key.
        data = kube_emulator.get("v1/configmaps", NS, names.rendezvous_name("demo")).get("data")
        assert not any(k.startswith("meta.") for k in data or {})
        return (data or {}).get(BARRIER_KEY)

    entry = decode_entry(BARRIER_KEY, await eventually(barrier, "the barrier of epoch 0"))
    assert isinstance(entry, BarrierEntry) and entry.epoch == 0
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
    assert entry.policy_uids == (uids["demo-policy-0-e0"], uids["demo-policy-1-e0"])
