"""The operator restarts mid-job: its kopf task is cancelled and a new one started, twice —
once while the ranks wait for the barrier, once while refits run.

Real: kopf in the test's loop, the operator, ``refit-worker`` processes started by the
process kubelet (``tests/e2e/kubelet_bridge.py``), the ConfigMap rendezvous over the
kubernetes client, NIXL, gloo.  Emulated: only the API server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.e2e.kubelet_bridge import KubeletBridge, operator_cluster
from tests.emulator import ApiEmulator
from tests.integration.support import OperatorRun, eventually

ROOT = Path(__file__).resolve().parents[2]
JOBS = "refit.dev/v1alpha1/refitjobs"
PODS = "v1/pods"
NS = "default"
REFITS = 6

Cluster = tuple[ApiEmulator, KubeletBridge, OperatorRun]


@pytest.fixture()
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    async with operator_cluster(tmp_path, monkeypatch) as (api, bridge, run):
        yield api, bridge, run


def _status(api: ApiEmulator) -> dict[str, Any]:
    return api.get(JOBS, NS, "restart").get("status") or {}


def _created(api: ApiEmulator, resource: str) -> list[str]:
    """Names of every object of ``resource`` ever created (the store's history)."""
    return sorted(
        e.obj["metadata"]["name"]
        for e in api.store.events_since(0)
        if e.resource == resource and e.type == "ADDED"
    )


@pytest.mark.timeout(300)
async def test_operator_restart_mid_job(cluster: Cluster) -> None:
    api, bridge, run = cluster
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())
    doc["metadata"] = {"name": "restart", "namespace": NS}
    doc["spec"]["transfer"]["refits"] = REFITS
    api.create(JOBS, NS, doc)
    await eventually(lambda: len(api.list(PODS, NS)) == 4, "the gang's 4 pods", timeout=60)
    # 1: down before the barrier opens; the ranks publish meanwhile and wait.
    await run.stop()
    await asyncio.sleep(3)
    assert "barrier" not in (api.get("v1/configmaps", NS, "restart-rendezvous").get("data") or {})
    await run.start()
    before = await eventually(
        lambda: (s := _status(api)).get("refitsCompleted", 0) >= 1 and s,
        "the first refit after the restart",
        timeout=180,
    )
    # 2: down while refits run; the workers carry on without it.
    await run.stop()
    await asyncio.sleep(2)
    await run.start()
    status = await eventually(
        lambda: (s := _status(api)).get("phase") in ("Succeeded", "Failed") and s,
        "the job to finish after two operator restarts",
        timeout=240,
    )
    assert status["phase"] == "Succeeded", status
    # Status continued: the count only went up, and nothing was restarted or preempted.
    assert status["refitsCompleted"] == REFITS >= before["refitsCompleted"]
    assert status["restarts"] == 0 and status["preemptions"] == 0 and status["epoch"] == 0
    # No duplicate children: each was created exactly once across the three operators.
    assert _created(api, PODS) == sorted(
        [f"restart-policy-{r}" for r in range(2)] + [f"restart-rollout-{r}" for r in range(2)]
    )
    assert _created(api, "v1/configmaps") == ["restart-rendezvous"]
    assert _created(api, "v1/services") == ["restart-policy", "restart-rollout"]
    assert sorted(bridge.exit_codes.values()) == [0, 0, 0, 0]
