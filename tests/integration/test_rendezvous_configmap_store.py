"""The ConfigMap rendezvous store against the API emulator.

Real: the ``kubernetes`` client (its HTTP, its kubeconfig loader), worker processes
(``subprocess``) that find the API through ``KUBECONFIG`` as a pod would through its
kubeconfig, watch streams, merge patches, 410 Gone.  Emulated: the API server
(``tests/emulator``), which runs in the test's event loop; the store's blocking calls
run in threads (``asyncio.to_thread``) so the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tests.emulator import ApiEmulator, ApiFault

from refit_worker.contract.rendezvous import (
    BARRIER_KEY,
    RANKS_PER_SHARD,
    EntryError,
    Layout,
    aggregate_progress,
    make_preempt_notice,
    parse_key,
    shards_needed,
)
from refit_worker.rendezvous import PreemptionWatch, configmap_store
from refit_worker.rendezvous.configmap_store import ConfigMapStore
from refit_worker.rendezvous.store import Member, Preempted, RendezvousError, RendezvousTimeout

ROOT = Path(__file__).resolve().parents[2]
CM = "v1/configmaps"
NS = "default"
BASE = "job-rendezvous"

# A worker process: publish, wait for the barrier, read the peers, report, then (if asked)
# wait for a preemption notice.  One JSON line out.
WORKER = r"""
import json, sys
from refit_worker.rendezvous import ConfigMapStore, Member, Preempted
from refit_worker.contract.rendezvous import Layout, RefitReport
order = json.loads(sys.argv[1])
store = ConfigMapStore(order["base"], "default", Layout(*order["layout"]))
me = Member(order["role"], order["rank"], order["epoch"], order["uid"])
store.publish_metadata(me, json.dumps({"agent": f"{me.role}-{me.rank}"}))
out = {}
try:
    barrier = store.wait_barrier(me, timeout=60)
    peers = store.peers(me, barrier)
    out["peers"] = sorted(json.loads(e.agent)["agent"] for e in peers.values())
    store.write_progress(me, state="done", refits_completed=2, bytes_total=20,
                         recent=(RefitReport(refit=1, bytes=10, seconds=0.25),))
    if order.get("await_preempt"):
        out["notice"] = store.wait_preemption(me, timeout=60).reason
except Preempted as exc:
    out["preempted"] = exc.notice.reason
print(json.dumps(out), flush=True)
store.close()
"""


@pytest.fixture()
async def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ApiEmulator]:
    async with ApiEmulator(tmp_path, history_limit=50) as emulator:
        monkeypatch.setenv("KUBECONFIG", str(emulator.kubeconfig_path))
        yield emulator


def make_maps(api: ApiEmulator, layout: Layout, base: str = BASE) -> list[str]:
    """What the operator does before it creates the pods: every map of the layout (its
    own, then each role's), empty.  Their names, in shard order."""
    names = [layout.name(base, shard) for shard in range(layout.shards)]
    for name in names:
        api.create(CM, NS, {"metadata": {"name": name}, "data": {}})
    return names


async def spawn(order: dict[str, Any]) -> asyncio.subprocess.Process:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "worker"), os.environ.get("PYTHONPATH", "")]),
    )
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        WORKER,
        json.dumps(order),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def result(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    out, err = await asyncio.wait_for(proc.communicate(), timeout=90)
    assert proc.returncode == 0, err.decode()
    parsed: dict[str, Any] = json.loads(out)
    return parsed


def ranks(policy: int, rollout: int) -> list[tuple[str, int]]:
    return [("policy", r) for r in range(policy)] + [("rollout", r) for r in range(rollout)]


async def test_gang_meets_over_sharded_configmaps(api: ApiEmulator) -> None:
    # The operator's map, then each role's cut by rank in blocks of RANKS_PER_SHARD:
    # policy rank 99 sits in <base>-policy, policy rank 100 in <base>-policy-1, the
    # rollout ranks in <base>-rollout.  Policy ranks 0..98 publish from here; the ranks
    # either side of each cut are real processes.
    policy = RANKS_PER_SHARD + 1
    layout = (policy, 2, shards_needed(policy, 2))
    assert make_maps(api, Layout(*layout)) == [
        BASE,
        f"{BASE}-policy",
        f"{BASE}-policy-1",
        f"{BASE}-rollout",
    ]
    coordinator = ConfigMapStore(BASE, NS, Layout(*layout))
    for rank in range(RANKS_PER_SHARD - 1):
        member = Member("policy", rank, 0, f"uid-policy-{rank}")
        await asyncio.to_thread(
            coordinator.publish_metadata, member, json.dumps({"agent": f"policy-{rank}"})
        )
    spawned = [("policy", policy - 2), ("policy", policy - 1), ("rollout", 0), ("rollout", 1)]
    procs = [
        await spawn(
            {
                "base": BASE,
                "layout": layout,
                "role": role,
                "rank": rank,
                "epoch": 0,
                "uid": f"uid-{role}-{rank}",
            }
        )
        for role, rank in spawned
    ]
    try:
        barrier = await asyncio.to_thread(coordinator.open_barrier, 0, 60)
        assert barrier.policy_uids == tuple(f"uid-policy-{r}" for r in range(policy))
        everyone = sorted(f"{role}-{rank}" for role, rank in ranks(*layout[:2]))
        for proc in procs:
            assert (await result(proc))["peers"] == everyone
        snap = await asyncio.to_thread(coordinator.snapshot, 0)
        summary = aggregate_progress(snap, *layout[:2])
        assert (summary.refits_completed, summary.bytes_total, summary.ranks_done) == (2, 40, 4)
        assert summary.last_refit_gbps == pytest.approx(20 / 0.25 / 1e9)
    finally:
        coordinator.close()
    _assert_keys_at_home(api)


def _assert_keys_at_home(api: ApiEmulator) -> None:
    """After the gang of 101 policy ranks and 2 rollout ranks: each rank's keys sit in its
    role's map of its block; the barrier in the operator's."""
    assert sorted(api.get(CM, NS, BASE)["data"]) == [BARRIER_KEY]
    assert sorted(api.get(CM, NS, f"{BASE}-policy")["data"]) == sorted(
        [f"progress.policy.{RANKS_PER_SHARD - 1}"]
        + [f"meta.policy.{r}" for r in range(RANKS_PER_SHARD)]
    )
    assert sorted(api.get(CM, NS, f"{BASE}-policy-1")["data"]) == [
        f"meta.policy.{RANKS_PER_SHARD}",
        f"progress.policy.{RANKS_PER_SHARD}",
    ]
    assert sorted(api.get(CM, NS, f"{BASE}-rollout")["data"]) == [
        "meta.rollout.0",
        "meta.rollout.1",
        "progress.rollout.0",
        "progress.rollout.1",
    ]


async def test_writes_are_merge_patches_of_own_key(api: ApiEmulator) -> None:
    store = ConfigMapStore(BASE, NS, Layout(3, 3, 1))
    make_maps(api, store.layout)
    api.patch(CM, NS, f"{BASE}-policy", {"data": {"note.by.admin": "kept"}})
    members = [Member(role, rank, 0, f"u{role}{rank}") for role, rank in ranks(3, 3)]  # type: ignore[arg-type]
    await asyncio.gather(*(asyncio.to_thread(store.publish_metadata, m, "{}") for m in members))
    for role in ("policy", "rollout"):
        data = api.get(CM, NS, f"{BASE}-{role}")["data"]
        assert sorted(k for k in data if parse_key(k)) == [f"meta.{role}.{r}" for r in range(3)]
    assert api.get(CM, NS, f"{BASE}-policy")["data"]["note.by.admin"] == "kept"
    assert api.get(CM, NS, BASE)["data"] == {}  # workers never write the operator's map
    patches = [r for r in api._handler if r.method.value == "PATCH"]
    assert len(patches) == 6
    assert {r.headers.get("Content-Type") for r in patches} == {"application/merge-patch+json"}
    assert all(list(r.data) == ["data"] and len(r.data["data"]) == 1 for r in patches)
    store.close()


async def test_preemption_notice_stops_both_roles(api: ApiEmulator) -> None:
    layout = (1, 1, 1)
    make_maps(api, Layout(*layout))
    procs = [
        await spawn(
            {
                "base": BASE,
                "layout": layout,
                "role": role,
                "rank": rank,
                "epoch": 3,
                "uid": f"u-{role}",
                "await_preempt": True,
            }
        )
        for role, rank in ranks(1, 1)
    ]
    coordinator = ConfigMapStore(BASE, NS, Layout(*layout))
    await asyncio.to_thread(coordinator.open_barrier, 3, 60)
    await asyncio.to_thread(
        coordinator.post_preemption, make_preempt_notice(2, "job-rollout-0", "old", "stale")
    )
    await asyncio.sleep(0.5)
    assert all(proc.returncode is None for proc in procs)
    await asyncio.to_thread(
        coordinator.post_preemption,
        make_preempt_notice(3, "job-rollout-0", "u-rollout", "eviction"),
    )
    assert [(await result(p))["notice"] for p in procs] == ["eviction", "eviction"]
    coordinator.close()


async def test_watch_resumes_after_410_gone(
    api: ApiEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Watches end every second and are made again from the last resourceVersion seen.
    monkeypatch.setattr(configmap_store, "WATCH_SECONDS", 1)
    store = ConfigMapStore(BASE, NS, Layout(1, 1, 1))
    make_maps(api, store.layout)
    api.create(CM, NS, {"metadata": {"name": "busy"}, "data": {}})
    me = Member("policy", 0, 0, "p")
    waiter = asyncio.create_task(asyncio.to_thread(store.wait_barrier, me, 30))
    await asyncio.sleep(1.0)  # the waiter is watching now
    publish = ConfigMapStore(BASE, NS, Layout(1, 1, 1))
    await asyncio.to_thread(publish.publish_metadata, me, "{}")
    await asyncio.to_thread(publish.publish_metadata, Member("rollout", 0, 0, "r"), "{}")
    from refit_worker.contract.rendezvous import BarrierEntry, RolloutMember, encode_entry

    opened = BarrierEntry(epoch=0, policy_uids=("p",), rollout=(RolloutMember(uid="r"),))
    # Catch the waiter between two watches: it watches the operator's map and the policy
    # map, and the next watch request of each is held back (served late, not refused),
    # so no stream is open while the barrier is written.
    held = ApiFault(delay=2.5, resource=CM, watch=True, times=2)
    api.faults.add(held)
    deadline = time.monotonic() + 10
    while held.used < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert held.used == 2, "the waiter did not make a new watch of each map within 10 s"
    # Then, in one go, the barrier and enough other writes to push it out of the
    # emulator's 50-event history: the held watch resumes from a resourceVersion that is
    # too old (410 Gone), and only a list finds the barrier.
    api.patch(CM, NS, BASE, {"data": {BARRIER_KEY: encode_entry(BARRIER_KEY, opened)}})
    for i in range(60):
        api.patch(CM, NS, "busy", {"data": {"n": str(i)}})
    assert api.store.oldest_rv > int(api.get(CM, NS, BASE)["metadata"]["resourceVersion"])
    barrier = await asyncio.wait_for(waiter, timeout=40)
    assert barrier.policy_uids == ("p",)
    lists = [r for r in api._handler if r.method.value == "GET" and r.name == BASE]
    assert len(lists) >= 2  # the first read and the one after 410
    store.close()
    publish.close()


async def test_watch_renews_after_its_server_timeout(
    api: ApiEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(configmap_store, "WATCH_SECONDS", 1)
    store = ConfigMapStore(BASE, NS, Layout(1, 1, 1))
    make_maps(api, store.layout)
    me = Member("rollout", 0, 0, "r")
    waiter = asyncio.create_task(asyncio.to_thread(store.wait_preemption, me, 30))
    await asyncio.sleep(2.5)  # past two watch timeouts
    api.patch(
        CM,
        NS,
        BASE,
        {
            "data": {
                "preempt": make_preempt_notice(0, "job-policy-0", "p", "drain").model_dump_json()
            }
        },
    )
    assert (await asyncio.wait_for(waiter, timeout=20)).reason == "drain"
    watches = [r for r in api._handler if r.params.get("watch") == "true"]
    assert len(watches) >= 2
    store.close()


async def test_timeout_names_what_and_where(api: ApiEmulator) -> None:
    store = ConfigMapStore(BASE, NS, Layout(1, 1, 1))
    make_maps(api, store.layout)
    with pytest.raises(
        RendezvousTimeout,
        match=r"after 0.5s waiting for the barrier of epoch "
        r"7 \(key 'barrier'\) in ConfigMap "
        r"default/job-rendezvous, job-rendezvous-policy\b",
    ):
        await asyncio.to_thread(store.wait_barrier, Member("policy", 0, 7, "p"), 0.5)
    store.close()


async def test_garbage_value_and_missing_map_are_clear_errors(api: ApiEmulator) -> None:
    store = ConfigMapStore(BASE, NS, Layout(1, 1, 1))
    me = Member("policy", 0, 0, "p")
    with pytest.raises(
        RendezvousError,
        match=r"could not set key 'meta\.policy\.0' of ConfigMap "
        r"default/job-rendezvous-policy: HTTP 404",
    ):
        await asyncio.to_thread(store.publish_metadata, me, "{}")
    make_maps(api, store.layout)
    waiter = asyncio.create_task(asyncio.to_thread(store.wait_barrier, me, 30))
    await asyncio.sleep(0.5)
    api.patch(CM, NS, BASE, {"data": {"preempt": '{"v": 1, "epoch": 0, "pod": "x"'}})
    with pytest.raises(EntryError, match=r"'preempt': value is not JSON"):
        await asyncio.wait_for(waiter, timeout=20)
    api.patch(
        CM,
        NS,
        BASE,
        {
            "data": {
                "preempt": make_preempt_notice(
                    0, "job-rollout-0", "r", "eviction"
                ).model_dump_json()
            }
        },
    )
    with pytest.raises(Preempted, match="job preempted in epoch 0: eviction"):
        await asyncio.to_thread(store.wait_barrier, me, 5)
    store.close()


async def test_a_job_over_one_shard_spreads_and_fits(api: ApiEmulator) -> None:
    policy = rollout = 100
    shards = shards_needed(policy, rollout)
    assert shards == 3
    store = ConfigMapStore(BASE, NS, Layout(policy, rollout, shards))
    names = make_maps(api, store.layout)
    assert names == [BASE, f"{BASE}-policy", f"{BASE}-rollout"]
    agent = json.dumps({"name": "x" * 40, "meta": "QUJD" * 200})
    members = [
        Member(role, rank, 0, f"{role[0]}{rank:035d}")  # type: ignore[arg-type]
        for role, rank in ranks(policy, rollout)
    ]
    for chunk in range(0, len(members), 20):
        await asyncio.gather(
            *(
                asyncio.to_thread(store.publish_metadata, m, agent)
                for m in members[chunk : chunk + 20]
            )
        )
    await asyncio.to_thread(store.open_barrier, 0, 30)
    sizes = [len(json.dumps(api.get(CM, NS, name)).encode()) for name in names]
    assert all(size < 1 << 20 for size in sizes)
    counts = [len(api.get(CM, NS, name)["data"]) for name in names]
    assert counts == [1, 100, 100]  # the barrier in the operator's map, 100 ranks in each role's
    store.close()


async def test_preemption_watch_hears_the_notice_and_stops_promptly(api: ApiEmulator) -> None:
    store = ConfigMapStore(BASE, NS, Layout(1, 1, 1))
    make_maps(api, store.layout)
    me = Member("rollout", 0, 1, "r")
    idle = PreemptionWatch(store, me, lambda notice: None).start()
    await asyncio.sleep(0.5)
    started = time.monotonic()
    await asyncio.to_thread(idle.stop)
    assert time.monotonic() - started < 2.0
    assert idle.notice is None and idle.error is None

    heard = threading.Event()
    watch = PreemptionWatch(store, me, lambda notice: heard.set()).start()
    await asyncio.sleep(0.5)
    api.patch(
        CM,
        NS,
        BASE,
        {
            "data": {
                "preempt": make_preempt_notice(
                    1, "job-policy-1", "p1", "DisruptionTarget"
                ).model_dump_json()
            }
        },
    )
    assert await asyncio.to_thread(heard.wait, 20)
    assert watch.notice is not None and watch.notice.pod == "job-policy-1"
    await asyncio.to_thread(watch.stop)
    store.close()
