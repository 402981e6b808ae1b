"""The file-backed rendezvous store with real, concurrent processes.

Real: separate Python processes (``subprocess``) sharing a directory, their writes and
reads, waits that block until another process writes.  Nothing is emulated.  Processes
get their orders as JSON on the command line and answer as JSON on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from refit_worker.contract.config import RendezvousConfig, WorkerConfig
from refit_worker.contract.rendezvous import (
    MAX_PROGRESS_BYTES,
    MAX_RANKS,
    RANKS_PER_SHARD,
    EntryError,
    Layout,
    MetadataEntry,
    RolloutMember,
    aggregate_progress,
    make_preempt_notice,
    meta_key,
    shards_needed,
)
from refit_worker.rendezvous import FileStore, Member, RendezvousTimeout, open_store

ROOT = Path(__file__).resolve().parents[2]

# One worker process: publish, wait for the barrier, read peers, report progress, then
# optionally wait for a preemption notice.  Prints one JSON line with what it saw.
WORKER = r"""
import json, sys
from refit_worker.rendezvous import FileStore, Member, Preempted, RendezvousTimeout
from refit_worker.contract.rendezvous import Layout, RefitReport
order = json.loads(sys.argv[1])
store = FileStore(order["dir"], Layout(*order["layout"]))
me = Member(order["role"], order["rank"], order["epoch"], order["uid"])
store.publish_metadata(me, json.dumps({"agent": f"{me.role}-{me.rank}", "epoch": me.epoch}))
out = {}
try:
    barrier = store.wait_barrier(me, timeout=order["timeout"])
    peers = store.peers(me, barrier)
    out["peers"] = {f"{r}.{k}": json.loads(e.agent)["agent"] for (r, k), e in peers.items()}
    store.write_progress(me, state="done", refits_completed=1, bytes_total=100,
                         recent=(RefitReport(refit=0, bytes=100, seconds=0.5),))
    if order.get("await_preempt"):
        out["notice"] = store.wait_preemption(me, timeout=order["timeout"]).reason
except Preempted as exc:
    out["preempted"] = exc.notice.reason
except RendezvousTimeout as exc:
    out["timeout"] = str(exc)
print(json.dumps(out), flush=True)
"""

# Hammers its own keys: writes meta and progress `count` times, each a new value.
WRITER = r"""
import json, sys
from refit_worker.rendezvous import FileStore, Member
from refit_worker.contract.rendezvous import Layout, RefitReport
order = json.loads(sys.argv[1])
store = FileStore(order["dir"], Layout(*order["layout"]))
me = Member(order["role"], order["rank"], 0, order["uid"])
for i in range(order["count"]):
    store.publish_metadata(me, json.dumps({"n": i, "pad": "x" * 600}))
    store.write_progress(me, refits_completed=i)
"""

# Reads the whole store again and again while writers run; any torn value would raise.
READER = r"""
import json, sys, time
from refit_worker.rendezvous import FileStore
from refit_worker.contract.rendezvous import Layout, RefitReport
order = json.loads(sys.argv[1])
store = FileStore(order["dir"], Layout(*order["layout"]))
reads, end = 0, time.monotonic() + order["seconds"]
while time.monotonic() < end:
    store.snapshot(0)
    reads += 1
print(json.dumps({"reads": reads}), flush=True)
"""


def spawn(script: str, order: dict[str, Any]) -> subprocess.Popen[str]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "worker"), os.environ.get("PYTHONPATH", "")]),
    )
    return subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(order)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result(proc: subprocess.Popen[str], timeout: float = 60) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out) if out.strip() else {}


def ranks(policy: int, rollout: int) -> list[tuple[str, int]]:
    return [("policy", r) for r in range(policy)] + [("rollout", r) for r in range(rollout)]


def test_gang_publishes_meets_at_barrier_and_reports(tmp_path: Path) -> None:
    # Shard 0 is the operator's (the barrier); then the policy ranks in blocks of
    # RANKS_PER_SHARD (policy rank 99 in shard 1, rank 100 in shard 2); then the rollout
    # ranks (shard 3).  Policy ranks 0..98 are published from here; the ranks either side
    # of each cut are real processes, so the routing is exercised across processes.
    policy = RANKS_PER_SHARD + 1
    layout = (policy, 2, shards_needed(policy, 2))
    assert layout[2] == 4
    store = FileStore(tmp_path, Layout(*layout))
    for rank in range(RANKS_PER_SHARD - 1):
        me = Member("policy", rank, 1, f"uid-policy-{rank}")
        store.publish_metadata(me, json.dumps({"agent": f"policy-{rank}"}))
    spawned = [("policy", policy - 2), ("policy", policy - 1), ("rollout", 0), ("rollout", 1)]
    procs = {
        f"{role}.{rank}": spawn(
            WORKER,
            {
                "dir": str(tmp_path),
                "layout": layout,
                "role": role,
                "rank": rank,
                "epoch": 1,
                "uid": f"uid-{role}-{rank}",
                "timeout": 60,
            },
        )
        for role, rank in spawned
    }
    barrier = store.open_barrier(epoch=1, timeout=60)
    assert barrier.rollout == (
        RolloutMember(uid="uid-rollout-0"),
        RolloutMember(uid="uid-rollout-1"),
    )
    assert barrier.version == 1
    expected = {f"{role}.{rank}": f"{role}-{rank}" for role, rank in ranks(*layout[:2])}
    for proc in procs.values():
        assert result(proc)["peers"] == expected
    summary = aggregate_progress(store.snapshot(1), *layout[:2])
    assert (summary.refits_completed, summary.ranks_done, summary.bytes_total) == (1, 4, 200)
    assert _files(tmp_path, 0) == ["barrier"]
    assert len(_files(tmp_path, 1)) == RANKS_PER_SHARD + 1  # meta of 0..99, progress of 99
    assert _files(tmp_path, 2) == [f"meta.policy.{policy - 1}", f"progress.policy.{policy - 1}"]
    assert _files(tmp_path, 3) == [
        "meta.rollout.0",
        "meta.rollout.1",
        "progress.rollout.0",
        "progress.rollout.1",
    ]


def _files(directory: Path, shard: int) -> list[str]:
    return sorted(p.name for p in (directory / f"shard-{shard}").iterdir())


def test_concurrent_writers_never_lose_or_tear_each_others_keys(tmp_path: Path) -> None:
    layout = (3, 3, 1)
    reader = spawn(READER, {"dir": str(tmp_path), "layout": layout, "seconds": 3})
    writers = [
        spawn(
            WRITER,
            {
                "dir": str(tmp_path),
                "layout": layout,
                "role": role,
                "rank": rank,
                "uid": f"u-{role}-{rank}",
                "count": 150,
            },
        )
        for role, rank in ranks(3, 3)
    ]
    for proc in writers:
        result(proc)
    assert result(reader)["reads"] > 0
    snap = FileStore(tmp_path, Layout(*layout)).snapshot(0)
    for role, rank in ranks(3, 3):
        assert json.loads(snap.meta[(role, rank)].agent)["n"] == 149  # type: ignore[index]
        assert snap.progress[(role, rank)].refits_completed == 149  # type: ignore[index]
    written = sorted(p.parent.name for p in tmp_path.glob("shard-*/meta.*"))
    assert written == ["shard-1"] * 3 + ["shard-2"] * 3  # each role's map holds its keys
    leftovers = [p.name for p in tmp_path.glob("shard-*/*") if p.name.startswith(".")]
    assert leftovers == []


def test_preemption_notice_reaches_every_rank_of_its_epoch_only(tmp_path: Path) -> None:
    layout = (1, 1, 1)
    store = FileStore(tmp_path, Layout(*layout))
    procs = [
        spawn(
            WORKER,
            {
                "dir": str(tmp_path),
                "layout": layout,
                "role": role,
                "rank": rank,
                "epoch": 2,
                "uid": f"u{role}",
                "timeout": 60,
                "await_preempt": True,
            },
        )
        for role, rank in ranks(1, 1)
    ]
    store.open_barrier(epoch=2, timeout=60)
    # A notice of the previous epoch must not stop the gang of epoch 2.
    store.post_preemption(make_preempt_notice(1, "job-rollout-0", "old", "stale"))
    time.sleep(0.5)
    assert all(proc.poll() is None for proc in procs)
    store.post_preemption(make_preempt_notice(2, "job-rollout-0", "new", "DisruptionTarget"))
    assert [result(proc)["notice"] for proc in procs] == ["DisruptionTarget"] * 2


def test_notice_before_barrier_stops_the_wait(tmp_path: Path) -> None:
    layout = (1, 1, 1)
    store = FileStore(tmp_path, Layout(*layout))
    proc = spawn(
        WORKER,
        {
            "dir": str(tmp_path),
            "layout": layout,
            "role": "policy",
            "rank": 0,
            "epoch": 0,
            "uid": "u",
            "timeout": 60,
        },
    )
    store.post_preemption(make_preempt_notice(0, "job-policy-0", "u", "node drain"))
    assert result(proc) == {"preempted": "node drain"}


def test_entries_of_an_old_epoch_do_not_open_the_barrier(tmp_path: Path) -> None:
    layout = Layout(1, 1, 1)
    store = FileStore(tmp_path, layout)
    store.publish_metadata(Member("policy", 0, 0, "old-p"), "{}")
    store.publish_metadata(Member("rollout", 0, 0, "old-r"), "{}")
    with pytest.raises(
        RendezvousTimeout, match="waiting for metadata of all 2 ranks of epoch 1 in"
    ):
        store.open_barrier(epoch=1, timeout=0.3)
    store.publish_metadata(Member("policy", 0, 1, "new-p"), "{}")
    store.publish_metadata(Member("rollout", 0, 1, "new-r"), "{}")
    assert store.open_barrier(epoch=1, timeout=5).policy_uids == ("new-p",)


def test_wait_times_out_naming_what_it_waited_for_without_spinning(tmp_path: Path) -> None:
    store = FileStore(tmp_path, Layout(1, 1, 1))
    me = Member("rollout", 0, 3, "u")
    cpu, wall = time.process_time(), time.monotonic()
    with pytest.raises(
        RendezvousTimeout,
        match=r"after 1s waiting for the barrier of epoch 3 "
        r"\(key 'barrier'\)",
    ):
        store.wait_barrier(me, timeout=1.0)
    assert time.monotonic() - wall >= 1.0
    # Bounded back-off: a second of waiting must not burn a second of CPU.
    assert time.process_time() - cpu < 0.5
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="must be a finite number of seconds > 0"):
            store.wait_preemption(me, timeout=bad)


def test_garbage_and_tampering_name_the_key(tmp_path: Path) -> None:
    store = FileStore(tmp_path, Layout(1, 1, 1))
    me = Member("policy", 0, 0, "me")
    # Out of its home (the rollout map) a key is not read at all, garbage or not.
    (tmp_path / "shard-0" / "progress.rollout.0").write_text("{half a val")
    assert store.snapshot(0).progress == {}
    home = tmp_path / f"shard-{store.layout.shard_of('progress.rollout.0')}"
    (home / "progress.rollout.0").write_text("{half a val")
    with pytest.raises(EntryError, match=r"'progress\.rollout\.0': value is not JSON"):
        store.snapshot(0)
    (home / "progress.rollout.0").write_bytes(b"x" * 100_000)
    limit = f"over the {MAX_PROGRESS_BYTES}-byte limit"
    with pytest.raises(EntryError, match=f"value is 100000 bytes, {limit}"):
        store.snapshot(0)
    # Past what the store reads at all, the message still quotes the file's real size.
    (home / "progress.rollout.0").write_bytes(b"x" * (16 << 20))
    with pytest.raises(EntryError, match=f"value is 16777216 bytes, {limit}"):
        store.snapshot(0)
    (home / "progress.rollout.0").unlink()
    # Another pod wrote under this rank's key, and the coordinator recorded that pod.
    store.publish_metadata(Member("policy", 0, 0, "intruder"), "{}")
    store.publish_metadata(Member("rollout", 0, 0, "r"), "{}")
    store.open_barrier(epoch=0, timeout=5)
    with pytest.raises(
        EntryError, match="lists pod uid 'intruder' for policy rank 0, but this pod is 'me'"
    ):
        store.wait_barrier(me, timeout=5)
    # A metadata entry replaced after the barrier opened does not match the barrier.
    barrier = store.wait_barrier(Member("rollout", 0, 0, "r"), timeout=5)
    store.publish_metadata(Member("rollout", 0, 0, "late"), "{}")
    with pytest.raises(EntryError, match="written by pod uid 'late', but the barrier recorded 'r'"):
        store.peers(Member("policy", 0, 0, "intruder"), barrier)


def test_bad_layouts_and_members_are_refused(tmp_path: Path) -> None:
    # Too few shards for the world sizes (an older config's 1) are raised to what they
    # need: the operator's map and each role's blocks.
    assert Layout(100, 100, 1).shards == 3
    assert Layout(101, 100, 9).shards == 9
    with pytest.raises(ValueError, match=f"total ranks {MAX_RANKS + 1} is outside"):
        Layout(MAX_RANKS, 1, 1)
    with pytest.raises(ValueError, match="world sizes must be >= 1"):
        Layout(0, 1, 1)
    config = WorkerConfig(
        job="j",
        role="policy",
        rank=0,
        policy_world_size=1,
        rollout_world_size=1,
        rendezvous=RendezvousConfig(store="file", location=str(tmp_path)),
    )
    with pytest.raises(ValueError, match="REFIT_POD_UID is empty"):
        Member.from_config(config)
    for args, message in (
        (("critic", 0, 0, "u"), "role 'critic'"),
        (("policy", -1, 0, "u"), "member rank must be an int >= 0, got -1"),
        (("policy", 0, True, "u"), "member epoch must be an int >= 0"),
        (("policy", 0, 0, "a b"), "pod uid 'a b' is not 1..40 characters"),
        (("policy", 0, 0, "x" * 41), "is not 1..40 characters"),
    ):
        with pytest.raises(ValueError, match=message):
            Member(*args)  # type: ignore[arg-type]
    store = open_store(config)
    assert isinstance(store, FileStore)
    with pytest.raises(EntryError, match="a MetadataEntry cannot be stored"):
        store.put_entry(
            "barrier", MetadataEntry(epoch=0, uid="u", role="policy", rank=0, agent="{}")
        )
    assert not (tmp_path / "shard-0" / "barrier").exists()
    assert meta_key("policy", 0) not in store.read_data()


def test_importing_the_stores_loads_no_kubernetes_client() -> None:
    # The API client is configured at first use; importing must not read any kubeconfig.
    code = (
        "import sys, refit_worker.rendezvous as r; "
        "print(sorted(m for m in ('kubernetes', 'urllib3') if m in sys.modules))"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "worker"), KUBECONFIG="/nonexistent")
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "[]"


def test_patch_shard_sets_and_deletes_keys_like_a_merge_patch(tmp_path: Path) -> None:
    store = FileStore(tmp_path, Layout(1, 1, 1))
    store.publish_metadata(Member("policy", 0, 0, "p"), "{}")
    shard = store.layout.shard_of(meta_key("policy", 0))
    assert store.read_shard(shard) == {meta_key("policy", 0): store.read_data()["meta.policy.0"]}
    store.patch_shard(shard, {"note": "x", "meta.policy.0": None, "meta.rollout.9": None})
    assert store.read_shard(shard) == {"note": "x"}  # as a ConfigMap's data would show it
    assert store.snapshot(0).meta == {}  # and readers of the protocol pass over it
    with pytest.raises(ValueError, match=r"not valid rendezvous keys: '\.\.', 'a/b'"):
        store.patch_shard(shard, {"note": None, "..": None, "a/b": "y"})
    assert (tmp_path / f"shard-{shard}" / "note").exists()  # refused as a whole
