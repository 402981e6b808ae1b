"""A RefitJob end to end on the operator: kopf in the test's loop, the API emulator, and
real worker processes started by the process kubelet (through :mod:`.kubelet_bridge`),
talking to the emulator's ConfigMaps (rendezvous) with the kubernetes client, streaming
over real NIXL and stopped by real signals through the preStop hook.

Emulated: only the Kubernetes API server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.e2e.kubelet_bridge import KubeletBridge, operator_cluster
from tests.emulator import ApiEmulator
from tests.integration.support import eventually

ROOT = Path(__file__).resolve().parents[2]
JOBS = "refit.dev/v1alpha1/refitjobs"
PODS = "v1/pods"
NS = "default"


def _job(name: str, refits: int) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NS}
    doc["spec"]["transfer"]["refits"] = refits
    return doc


@pytest.fixture()
async def cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[ApiEmulator, KubeletBridge]]:
    async with operator_cluster(tmp_path, monkeypatch) as (api, bridge, _run):
        yield api, bridge


def _status(api: ApiEmulator, name: str) -> dict[str, Any]:
    return api.get(JOBS, NS, name).get("status") or {}


async def test_two_by_two_three_refits_on_configmaps(
    cluster: tuple[ApiEmulator, KubeletBridge],
) -> None:
    api, bridge = cluster
    api.create(JOBS, NS, _job("e2e", refits=3))
    status = await eventually(
        lambda: (s := _status(api, "e2e")).get("phase") in ("Succeeded", "Failed") and s,
        "the job to finish",
        timeout=240,
    )
    assert status["phase"] == "Succeeded", status
    assert status["refitsCompleted"] == 3
    assert status["bytesTransferred"] > 0
    assert status["lastThroughputBytesPerSecond"] > 0
    assert status["restarts"] == 0 and status["preemptions"] == 0
    # Every rank exited 0: each rollout rank checked every tensor bit for bit before each
    # commit (a mismatch exits 1 and would have failed the job).
    assert sorted(bridge.exit_codes.values()) == [0, 0, 0, 0]
    data = api.get("v1/configmaps", NS, "e2e-rendezvous")["data"]
    assert {"meta.policy.0", "meta.rollout.1", "barrier", "progress.rollout.0"} <= set(data)


async def test_drain_mid_refit_preempts_the_gang(
    cluster: tuple[ApiEmulator, KubeletBridge],
) -> None:
    api, bridge = cluster
    api.create(JOBS, NS, _job("drain", refits=6))
    await eventually(
        lambda: _status(api, "drain").get("refitsCompleted", 0) >= 1, "the first refit", timeout=180
    )
    victim = api.get(PODS, NS, "drain-rollout-1")
    old_uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in api.list(PODS, NS)}
    # What the eviction API does on a drain: DisruptionTarget, then a graceful delete.
    api.patch(
        PODS,
        NS,
        "drain-rollout-1",
        {
            "status": {
                "conditions": [
                    *victim["status"]["conditions"],
                    {
                        "type": "DisruptionTarget",
                        "status": "True",
                        "reason": "EvictionByEvictionAPI",
                    },
                ]
            }
        },
        status=True,
    )
    api.delete(PODS, NS, "drain-rollout-1")
    status = await eventually(
        lambda: (s := _status(api, "drain")).get("phase") in ("Succeeded", "Failed") and s,
        "the job to finish after the drain",
        timeout=300,
    )
    assert status["phase"] == "Succeeded", status
    assert status["preemptions"] == 1 and status["restarts"] == 0
    assert status["epoch"] == 1
    assert status["refitsCompleted"] == 6
    # Every rank of both roles of epoch 0 stopped on its own, within the grace period: as
    # preempted (83) or, for the evicted pod's signal, its handler's clean exit — never
    # SIGKILL (137) and never a failure.
    old = {(n, u): bridge.exit_codes.get((n, u)) for n, u in old_uids.items()}
    assert all(code == 83 for code in old.values()), old
    new = [c for (n, u), c in bridge.exit_codes.items() if (n, u) not in old]
    assert sorted(new) == [0, 0, 0, 0]
