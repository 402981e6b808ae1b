"""API faults injected in the emulator: 409 conflicts, 410 Gone on watches, 500s and slow
answers.  The ConfigMap rendezvous store and the operator retry with back-off and lose
nothing.

Real: the ``kubernetes`` client and its HTTP (the store), kopf with our handlers and
aiohttp client (the operator).  Emulated: the API server, with the fault rules of
``tests/emulator/faults.py``; no kubelet (the test writes pod status as one would).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.emulator import ApiEmulator, ApiFault
from tests.support.operator_run import (
    JOBS,
    NS,
    PODS,
    OperatorRun,
    eventually,
    load_job,
    set_pod_phase,
)
from tests.support.rendezvous_maps import spread
from tests.support.reports import reports

from refit_operator.api import names
from refit_worker.contract.rendezvous import BARRIER_KEY, Layout, home_of_key, meta_key
from refit_worker.rendezvous.configmap_store import ConfigMapStore
from refit_worker.rendezvous.store import Member, RendezvousError

CM = "v1/configmaps"
BASE = "faulty-rendezvous"


@pytest.fixture()
async def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ApiEmulator]:
    async with ApiEmulator(tmp_path) as emulator:
        monkeypatch.setenv("KUBECONFIG", str(emulator.kubeconfig_path))
        yield emulator


def _make_maps(api: ApiEmulator, layout: Layout) -> list[str]:
    """The layout's maps (the operator's, then each role's), empty, as the operator makes
    them before the pods; their names in shard order."""
    maps = [layout.name(BASE, shard) for shard in range(layout.shards)]
    for name in maps:
        api.create(CM, NS, {"metadata": {"name": name}, "data": {}})
    return maps


def _members(policy: int, rollout: int) -> list[Member]:
    return [Member("policy", r, 0, f"uid-p{r}") for r in range(policy)] + [
        Member("rollout", r, 0, f"uid-r{r}") for r in range(rollout)
    ]


async def test_store_write_backs_off_then_gives_up_naming_the_configmap(
    api: ApiEmulator,
) -> None:
    store = ConfigMapStore(BASE, NS, Layout(1, 1, 1))
    own = _make_maps(api, store.layout)[1]  # the policy ranks' map
    assert own == f"{BASE}-policy"
    me = Member("policy", 0, 0, "uid-p0")
    try:
        # Four 500s: the fifth attempt lands, after waits that double each time.
        api.faults.add(ApiFault(code=500, method="PATCH", resource=CM, times=4))
        await asyncio.to_thread(store.publish_metadata, me, json.dumps({"agent": "a"}))
        assert meta_key("policy", 0) in api.get(CM, NS, own)["data"]
        at = [h.at for h in api.faults.hits]
        gaps = [b - a for a, b in itertools.pairwise(at)]
        assert len(gaps) == 3 and all(b > a * 1.5 for a, b in itertools.pairwise(gaps))
        assert gaps[0] >= 0.09, gaps
        # Five: the store gives up with an error that names the map and the status.
        api.faults.add(ApiFault(code=503, method="PATCH", resource=CM, times=5))
        with pytest.raises(RendezvousError, match=rf"ConfigMap {NS}/{own}: HTTP 503"):
            await asyncio.to_thread(store.write_progress, me, refits_completed=1)
        assert "progress.policy.0" not in api.get(CM, NS, own)["data"]
        # A 404 is not transient: no retry.
        before = len(api.faults.hits)
        api.faults.add(ApiFault(code=404, method="PATCH", resource=CM, times=3))
        with pytest.raises(RendezvousError, match="HTTP 404"):
            await asyncio.to_thread(store.write_progress, me, refits_completed=1)
        assert len(api.faults.hits) == before + 1
    finally:
        store.close()


async def test_store_rendezvous_under_conflicts_errors_gone_watches_and_slowness(
    api: ApiEmulator,
) -> None:
    layout = Layout(2, 2, 1)
    maps = _make_maps(api, layout)
    members = _members(2, 2)
    for fault in (
        ApiFault(code=409, method="PATCH", resource=CM, times=3),
        ApiFault(code=500, method="PATCH", resource=CM, times=3),
        ApiFault(code=410, resource=CM, watch=True, times=3),
        ApiFault(code=500, method="GET", resource=CM, watch=False, times=2),
        ApiFault(delay=0.3, method="GET", resource=CM, times=6),
    ):
        api.faults.add(fault)
    stores = [ConfigMapStore(BASE, NS, layout) for _ in members]
    coordinator = ConfigMapStore(BASE, NS, layout)
    try:

        async def rank(store: ConfigMapStore, me: Member) -> list[str]:
            await asyncio.to_thread(store.publish_metadata, me, json.dumps({"agent": me.rank}))
            barrier = await asyncio.to_thread(store.wait_barrier, me, 30.0)
            peers = await asyncio.to_thread(store.peers, me, barrier)
            await asyncio.to_thread(store.write_progress, me, refits_completed=1)
            return sorted(f"{role}{rank}" for role, rank in peers)

        waiting = [asyncio.create_task(rank(s, m)) for s, m in zip(stores, members, strict=True)]
        barrier = await asyncio.to_thread(coordinator.open_barrier, 0, 30.0)
        assert barrier.policy_uids == ("uid-p0", "uid-p1")
        results = await asyncio.wait_for(asyncio.gather(*waiting), timeout=60)
        assert results == [["policy0", "policy1", "rollout0", "rollout1"]] * 4
        # Nothing lost: every rank's metadata and progress, and the barrier, are there,
        # each in the map it belongs in.
        keys = {meta_key(m.role, m.rank) for m in members} | {BARRIER_KEY}
        keys |= {f"progress.{m.role}.{m.rank}" for m in members}
        for shard, name in enumerate(maps):
            data = api.get(CM, NS, name)["data"]
            assert set(data) == {k for k in keys if home_of_key(k) == layout.place(shard)}
        assert api.faults.spent(), [(f.code, f.delay, f.used) for f in api.faults.rules]
    finally:
        for store in [*stores, coordinator]:
            store.close()


# -- the operator ---------------------------------------------------------------------


def _job(name: str) -> dict[str, object]:
    return load_job(name)


async def test_operator_under_api_faults_creates_each_child_once_and_finishes(
    api: ApiEmulator,
) -> None:
    for fault in (
        ApiFault(code=500, method="POST", resource=PODS, times=3),
        ApiFault(code=409, method="PATCH", resource=JOBS, subresource="status", times=2),
        ApiFault(code=500, method="PATCH", resource=JOBS, times=2),
        ApiFault(code=410, resource=JOBS, watch=True, times=2),
        ApiFault(code=410, resource=PODS, watch=True, times=2),
        ApiFault(code=500, method="GET", resource=PODS, watch=False, times=2),
        ApiFault(delay=0.2, method="GET", times=20),
    ):
        api.faults.add(fault)
    run = OperatorRun(resync_seconds=2.0)
    await run.start()
    try:
        api.create(JOBS, NS, _job("flaky"))
        pods = await eventually(
            lambda: len(api.list(PODS, NS)) == 4 and api.list(PODS, NS),
            "4 pods despite the faults",
            timeout=90,
        )
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
        for name in uids:
            set_pod_phase(api, name, "Running")
        await eventually(
            lambda: _status(api).get("phase") == "Running", "phase Running", timeout=90
        )
        # As workers would: report every refit, then exit 0.
        data = reports(uids, refits=load_job()["spec"]["transfer"]["refits"])
        for name, own in spread("flaky", data).items():  # each into its role's map
            api.patch(CM, NS, name, {"data": own})
        for name in uids:
            set_pod_phase(api, name, "Succeeded")
        status = await eventually(
            lambda: _status(api).get("phase") == "Succeeded" and _status(api),
            "phase Succeeded",
            timeout=90,
        )
    finally:
        await run.stop()
    assert status["restarts"] == 0 and status["preemptions"] == 0 and status["epoch"] == 0
    # Each child was created once, and no pod was replaced: the failed creates were
    # retried, not doubled (the store's history holds every creation).
    added = [
        (e.obj["metadata"]["name"], e.obj["metadata"]["uid"])
        for e in api.store.events_since(0)
        if e.resource == PODS and e.type == "ADDED"
    ]
    assert sorted(added) == sorted(uids.items())
    for resource, want in (
        (CM, sorted(names.rendezvous_maps("flaky", 2, 2))),
        ("v1/services", ["flaky-policy", "flaky-rollout"]),
    ):
        assert sorted(o["metadata"]["name"] for o in api.list(resource, NS)) == want
    assert api.faults.spent(), [(f.code, f.method, f.used, f.times) for f in api.faults.rules]


def _status(api: ApiEmulator) -> dict[str, object]:
    status: dict[str, object] = api.get(JOBS, NS, "flaky").get("status") or {}
    return status
