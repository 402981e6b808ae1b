"""The store's protocol v3 steps over a real file store: waiting to be a member, a
rollout rank rejoining a later policy epoch, a stale or removed rank, notices that stop
only the policy gang, progress of any epoch.

Real: a :class:`FileStore` on disk, waits in a thread while the test plays the
coordinator with :func:`membership` (the operator's decision).  Nothing is emulated.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from refit_worker.contract.rendezvous import (
    BARRIER_KEY,
    RANKS_PER_SHARD,
    BarrierEntry,
    EntryError,
    Layout,
    LivePod,
    MetadataEntry,
    PreemptNotice,
    RolloutMember,
    encode_entry,
    make_preempt_notice,
    membership,
    meta_key,
)
from refit_worker.contract.roles import Role
from refit_worker.rendezvous import FileStore, Member, Preempted, PreemptionWatch, Removed

T = TypeVar("T")
P0 = Member("policy", 0, 0, "p0")
R0 = Member("rollout", 0, 0, "r0")
R1 = Member("rollout", 1, 0, "r1", generation=2)


def _store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path, Layout(1, 2, 1))


def _open(store: FileStore, epoch: int, live: dict[tuple[Role, int], LivePod]) -> BarrierEntry:
    """Play the coordinator once: write what :func:`membership` decides."""
    barrier = membership(store.snapshot(epoch), 1, 2, live, store.barrier())
    assert barrier is not None
    store.put_entry(BARRIER_KEY, barrier)
    return barrier


def _in_thread(call: Callable[[], T]) -> tuple[threading.Thread, list[T | BaseException]]:
    out: list[T | BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # handed to the test to assert on
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _eventually(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


LIVE: dict[tuple[Role, int], LivePod] = {
    ("policy", 0): LivePod("p0"),
    ("rollout", 0): LivePod("r0"),
    ("rollout", 1): LivePod("r1", 2),
}


def test_members_wait_until_listed(tmp_path: Path) -> None:
    store = _store(tmp_path)
    for me in (P0, R0, R1):
        store.publish_metadata(me, json.dumps({"name": me.uid}))
    thread, out = _in_thread(lambda: store.wait_membership(R1, 30))
    opened = _open(store, 0, LIVE)
    thread.join(30)
    assert out == [opened]
    assert opened.is_member("rollout", 1, "r1", 2)
    assert store.wait_membership(P0, 5) == opened
    peers = store.peers(P0, opened)
    assert sorted(peers) == [("policy", 0), ("rollout", 0), ("rollout", 1)]
    assert peers[("rollout", 1)].generation == 2
    assert store.barrier() == opened and store.barrier(0) == opened and store.barrier(1) is None


def test_a_rollout_rank_rejoins_a_later_epoch_with_its_own_agent(tmp_path: Path) -> None:
    store = _store(tmp_path)
    for me in (P0, R0, R1):
        store.publish_metadata(me, json.dumps({"name": me.uid}))
    _open(store, 0, LIVE)
    # The policy gang restarted: epoch 1, a new policy pod; rollout rank 0 still at 0.
    new_policy = Member("policy", 0, 1, "p0-e1")
    store.publish_metadata(new_policy, json.dumps({"name": "p0-e1"}))
    store.publish_metadata(Member("rollout", 1, 1, "r1", 2), json.dumps({"name": "r1"}))
    live = LIVE | {("policy", 0): LivePod("p0-e1"), ("rollout", 0): LivePod("r0", running=False)}
    first = _open(store, 1, live)
    assert first.epoch == 1 and first.members() == (1,)
    thread, out = _in_thread(lambda: store.wait_membership(R0, 30))

    def rejoined() -> bool:
        entry = store.snapshot(1).meta.get(("rollout", 0))
        return entry is not None and entry.uid == "r0"

    _eventually("rollout rank 0's meta rewritten for epoch 1", rejoined)
    entry = store.snapshot(1).meta[("rollout", 0)]
    assert isinstance(entry, MetadataEntry) and json.loads(entry.agent) == {"name": "r0"}
    second = _open(store, 1, LIVE | {("policy", 0): LivePod("p0-e1")})
    thread.join(30)
    assert out == [second]
    assert (second.epoch, second.version, second.members()) == (1, 2, (0, 1))


def test_a_replacement_waiting_for_its_epoch_joins_a_new_policy_gang_that_published(
    tmp_path: Path,
) -> None:
    """CI on 3b37f43 (a real drain of the node holding policy rank 0 and rollout rank 0):
    rollout rank 0's replacement started at epoch 0 just before the policy gang's restart;
    epoch 1's first barrier waits for every rollout slot's pod to publish for it, and the
    replacement waited for a barrier of epoch 0 or later: neither came (60 s, every rank
    failed).  Now it rejoins the new gang's epoch as soon as that gang published."""
    store = _store(tmp_path)
    replacement = Member("rollout", 0, 0, "r0-g1", generation=1)
    store.publish_metadata(replacement, json.dumps({"name": "r0-g1"}))
    thread, out = _in_thread(lambda: store.wait_membership(replacement, 30))
    # The restarted gang and the surviving rollout rank publish for epoch 1; no barrier yet.
    store.publish_metadata(Member("policy", 0, 1, "p0-e1"), "{}")
    store.publish_metadata(Member("rollout", 1, 1, "r1", 2), "{}")
    live = LIVE | {("policy", 0): LivePod("p0-e1"), ("rollout", 0): LivePod("r0-g1", 1)}

    def first_opening() -> BarrierEntry | None:
        # The coordinator's rule for an epoch's first barrier: every rollout slot held.
        want = membership(store.snapshot(1), 1, 2, live, None)
        return want if want is not None and None not in want.rollout else None

    _eventually("epoch 1's first barrier to be possible", lambda: first_opening() is not None)
    opened = first_opening()
    assert opened is not None
    store.put_entry(BARRIER_KEY, opened)
    thread.join(30)
    assert out == [opened]
    assert opened.epoch == 1 and opened.is_member("rollout", 0, "r0-g1", 1)


def test_a_stale_or_removed_rollout_rank_is_told(tmp_path: Path) -> None:
    store = _store(tmp_path)
    for me in (P0, R0, R1):
        store.publish_metadata(me, "{}")
    _open(store, 0, LIVE)
    # Rank 0 was replaced by generation 1 (another pod): the old pod is stale.
    store.publish_metadata(Member("rollout", 0, 0, "r0-g1", 1), "{}")
    _open(store, 0, LIVE | {("rollout", 0): LivePod("r0-g1", 1)})
    with pytest.raises(Preempted, match="pod 'r0-g1' \\(generation 1\\) holds this rank now"):
        store.wait_membership(R0, 5)
    # Scaled down to one rollout rank: rank 1 is past R.
    barrier = membership(store.snapshot(0), 1, 1, LIVE, store.barrier())
    assert barrier is not None and barrier.rollout_world_size == 1
    store.put_entry(BARRIER_KEY, barrier)
    with pytest.raises(Removed, match="rollout rank 1 is past the 1 rollout ranks") as info:
        store.wait_membership(R1, 5)
    assert info.value.barrier == barrier


def test_a_policy_rank_listed_under_another_uid_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    forged = BarrierEntry(epoch=0, policy_uids=("x",), rollout=(RolloutMember(uid="r0"), None))
    store.put_entry(BARRIER_KEY, forged)
    with pytest.raises(EntryError, match="lists pod uid 'x' for policy rank 0, but this pod"):
        store.wait_membership(P0, 5)


def test_a_policy_only_notice_passes_rollout_ranks_by(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.post_preemption(make_preempt_notice(0, "job-policy-0-e0", "p0", "drain", "policy"))
    assert store.preemption_notice(R0) is None
    assert store.preemption_notice(P0) is not None
    with pytest.raises(Preempted, match="drain"):
        store.wait_membership(P0, 5)
    seen: list[PreemptNotice] = []
    with PreemptionWatch(store, R0, seen.append) as watch:
        time.sleep(0.3)  # the watch has looked at the policy-only notice by now
        assert seen == []
        # A job-wide notice of a later epoch stops the rollout rank too: it would rejoin.
        store.post_preemption(make_preempt_notice(1, "job-rollout-1-g0", "r1", "eviction"))
        _eventually("the watch to see the job-wide notice", lambda: bool(seen))
    assert watch.error is None and [n.reason for n in seen] == ["eviction"]
    # A policy rank of epoch 0 does not stop for a notice of epoch 1.
    assert store.preemption_notice(P0) is None


def test_progress_all_gives_every_rank_whatever_its_epoch(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.write_progress(Member("rollout", 0, 3, "r0"), refits_completed=7)
    store.write_progress(Member("policy", 0, 5, "p0"), refits_completed=1)
    store.write_progress(Member("rollout", 1, 5, "r1", 2), state="left")
    found = store.progress_all()
    assert {k: (p.epoch, p.generation, p.state) for k, p in found.items()} == {
        ("rollout", 0): (3, 0, "running"),
        ("policy", 0): (5, 0, "running"),
        ("rollout", 1): (5, 2, "left"),
    }


def test_a_scale_up_past_a_shard_is_followed_by_the_ranks_already_running(
    tmp_path: Path,
) -> None:
    # 100 rollout ranks fill the rollout role's first map; rollout rank 100 lands in its
    # second, which the running ranks' layout did not have.
    rollout = RANKS_PER_SHARD
    old = FileStore(tmp_path, Layout(1, rollout, 1))
    old.publish_metadata(Member("policy", 0, 0, "p0"), "{}")
    for rank in range(rollout):
        old.publish_metadata(Member("rollout", rank, 0, f"r{rank}"), "{}")
    grown = FileStore(tmp_path, Layout(1, rollout + 1, 1))
    late = Member("rollout", rollout, 0, "late")
    grown.publish_metadata(late, "{}")
    assert old.layout.shards == 3 and grown.layout.shards == 4
    assert (tmp_path / "shard-3" / meta_key("rollout", rollout)).is_file()
    live = {("rollout", r): LivePod(f"r{r}") for r in range(rollout)}
    live.update({("policy", 0): LivePod("p0"), ("rollout", rollout): LivePod("late")})
    barrier = membership(grown.snapshot(0), 1, rollout + 1, live, None)  # type: ignore[arg-type]
    assert barrier is not None and barrier.members() == tuple(range(rollout + 1))
    old.put_entry(BARRIER_KEY, barrier)
    peers = old.peers(Member("policy", 0, 0, "p0"), barrier)
    assert peers[("rollout", rollout)].uid == "late" and len(peers) == rollout + 2
    assert old.layout == Layout(1, rollout + 1, 4)


def test_a_key_written_into_a_map_it_does_not_belong_in_is_not_read(tmp_path: Path) -> None:
    # A rollout pod may patch only its role's maps: what it puts there under the
    # operator's keys or a policy rank's is not read by any worker.
    store = FileStore(tmp_path, Layout(1, 1, 1))
    honest = Member("policy", 0, 0, "p0")
    store.publish_metadata(honest, '{"honest": 1}')
    store.publish_metadata(Member("rollout", 0, 0, "r0"), "{}")
    rollout_map = tmp_path / f"shard-{store.layout.role_shards('rollout')[0]}"
    forged = MetadataEntry(epoch=0, uid="p0", role="policy", rank=0, agent='{"forged": 1}')
    (rollout_map / "meta.policy.0").write_text(encode_entry("meta.policy.0", forged))
    live = {("policy", 0): LivePod("p0"), ("rollout", 0): LivePod("r0")}
    barrier = membership(store.snapshot(0), 1, 1, live, None)
    assert barrier is not None
    (rollout_map / BARRIER_KEY).write_text(encode_entry(BARRIER_KEY, barrier))
    assert store.barrier() is None  # the barrier is read from the operator's map only
    store.put_entry(BARRIER_KEY, barrier)
    assert store.peers(honest, barrier)[("policy", 0)].agent == '{"honest": 1}'
