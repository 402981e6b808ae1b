"""Unit tests of the pure rendezvous protocol: keys, entries, shards, decisions.

Nothing is emulated and nothing runs: these are pure functions over tables.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refit_worker.contract.rendezvous import (
    BARRIER_KEY,
    MAX_META_BYTES,
    MAX_PROGRESS_BYTES,
    MAX_RANKS,
    MAX_UID_CHARS,
    PREEMPT_KEY,
    PROTOCOL_VERSION,
    RANKS_PER_SHARD,
    SHARD_BUDGET_BYTES,
    BarrierEntry,
    EntryError,
    Key,
    MetadataEntry,
    PreemptNotice,
    ProgressEntry,
    RefitReport,
    aggregate_progress,
    barrier_ready,
    configmap_name,
    decode_entry,
    encode_entry,
    is_valid_data_key,
    make_barrier,
    make_preempt_notice,
    max_value_bytes,
    merge_patch,
    meta_key,
    parse_key,
    progress_key,
    read_snapshot,
    shard_of,
    shard_of_key,
    shards_needed,
)

AGENT = json.dumps({"name": "policy-0", "metadata": "QUJD" * 150, "buffers": [[1, 2, 0]]})


def meta(
    role: str = "policy", rank: int = 0, epoch: int = 0, uid: str = "uid-p0", agent: str = AGENT
) -> MetadataEntry:
    return MetadataEntry(epoch=epoch, uid=uid, role=role, rank=rank, agent=agent)  # type: ignore[arg-type]


def published(policy: int, rollout: int, epoch: int = 0) -> dict[str, str]:
    data = {}
    for role, world in (("policy", policy), ("rollout", rollout)):
        for rank in range(world):
            key = meta_key(role, rank)  # type: ignore[arg-type]
            data[key] = encode_entry(key, meta(role, rank, epoch, f"uid-{role}-{rank}"))
    return data


# -- keys ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "parsed"),
    [
        ("meta.policy.0", Key("meta", "policy", 0)),
        ("meta.rollout.17", Key("meta", "rollout", 17)),
        ("progress.rollout.3", Key("progress", "rollout", 3)),
        ("barrier", Key("barrier")),
        ("preempt", Key("preempt")),
        ("meta.policy.01", None),  # leading zero: two names for one rank
        ("meta.critic.0", None),
        ("meta.policy.-1", None),
        ("meta.policy", None),
        ("annotation.by.someone", None),
        ("Barrier", None),
    ],
)
def test_parse_key(key: str, parsed: Key | None) -> None:
    assert parse_key(key) == parsed
    if parsed is not None:
        assert parsed.name == key
        assert is_valid_data_key(key)


@pytest.mark.parametrize(
    ("role", "rank", "error"),
    [
        ("critic", 0, "role 'critic'"),
        ("policy", -1, "rank -1"),
        ("policy", True, "rank True"),
    ],
)
def test_key_builders_reject_bad_input(role: str, rank: int, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        meta_key(role, rank)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=error):
        progress_key(role, rank)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "valid"),
    [
        ("meta.policy.0", True),
        ("a-b_c.D9", True),
        ("", False),
        ("a/b", False),
        ("a b", False),
        ("x" * 254, False),
    ],
)
def test_valid_data_key(key: str, valid: bool) -> None:
    assert is_valid_data_key(key) is valid


# -- entries -------------------------------------------------------------------------------


def test_entries_round_trip() -> None:
    cases = [
        ("meta.policy.0", meta()),
        (
            "progress.rollout.1",
            ProgressEntry(
                epoch=2,
                uid="u",
                role="rollout",
                rank=1,
                state="done",
                first_refit=1,
                refits_completed=3,
                bytes_total=10,
                seconds_total=1.5,
                recent=(
                    RefitReport(refit=1, bytes=6, seconds=1.0),
                    RefitReport(refit=2, bytes=4, seconds=0.5),
                ),
                verification="checksums",
            ),
        ),
        (BARRIER_KEY, BarrierEntry(epoch=1, policy_uids=("a",), rollout_uids=("b", "c"))),
        (PREEMPT_KEY, make_preempt_notice(1, "job-rollout-0", "u1", "DisruptionTarget")),
    ]
    for key, entry in cases:
        text = encode_entry(key, entry)
        assert json.loads(text)["v"] == PROTOCOL_VERSION
        assert json.loads(text)["epoch"] == entry.epoch
        assert decode_entry(key, text) == entry


def _with(base: MetadataEntry, **changes: object) -> str:
    raw = json.loads(base.model_dump_json())
    raw.update(changes)
    return json.dumps(raw)


@pytest.mark.parametrize(
    ("key", "text", "reason"),
    [
        ("meta.policy.0", "not json", "value is not JSON"),
        ("meta.policy.0", "[1, 2]", "value is a JSON list, not an object"),
        (
            "meta.policy.0",
            _with(meta(), v=PROTOCOL_VERSION + 1),
            f"protocol version {PROTOCOL_VERSION + 1}, this reader speaks {PROTOCOL_VERSION}",
        ),
        ("meta.policy.0", _with(meta(), v=None), "protocol version None"),
        ("meta.policy.0", _with(meta(), epoch=-1), "epoch: Input should be greater than"),
        ("meta.policy.0", _with(meta(), epoch="3"), "epoch: Input should be a valid integer"),
        ("meta.policy.0", _with(meta(), extra=1), "extra: Extra inputs are not permitted"),
        ("meta.policy.0", _with(meta(), agent="{oops"), "agent metadata is not JSON"),
        ("meta.policy.0", _with(meta(), uid="bad uid!"), "uid: String should match pattern"),
        ("meta.policy.0", _with(meta(), uid=""), "uid: String should match pattern"),
        ("meta.policy.0", _with(meta(), rank=1), "holds the entry of policy rank 1"),
        ("meta.policy.0", _with(meta(), role="rollout"), "holds the entry of rollout rank 0"),
        ("meta.policy.0", "x" * (MAX_META_BYTES + 1), f"over the {MAX_META_BYTES}-byte limit"),
        ("progress.policy.0", _with(meta(agent="{}")), "does not match the progress schema"),
        (
            "preempt",
            json.dumps({"v": PROTOCOL_VERSION, "epoch": 0, "pod": "p", "uid": "u"}),
            "reason: Field required",
        ),
        ("somekey", "{}", "not a rendezvous key"),
    ],
    ids=lambda value: str(value)[:40],
)
def test_decode_names_key_and_problem(key: str, text: str, reason: str) -> None:
    with pytest.raises(EntryError) as info:
        decode_entry(key, text)
    assert info.value.key == key
    assert f"rendezvous key {key!r}" in str(info.value)
    assert reason in str(info.value)


def test_encode_refuses_misplaced_or_oversized_entries() -> None:
    with pytest.raises(EntryError, match="holds the entry of policy rank 0"):
        encode_entry("meta.policy.1", meta())
    with pytest.raises(EntryError, match="a MetadataEntry cannot be stored under this key"):
        encode_entry("progress.policy.0", meta())
    with pytest.raises(EntryError, match="a BarrierEntry cannot be stored"):
        encode_entry(PREEMPT_KEY, BarrierEntry(epoch=0, policy_uids=("a",), rollout_uids=("b",)))
    big = json.dumps({"blob": "x" * MAX_META_BYTES})
    with pytest.raises(EntryError, match="over the 5120-byte limit"):
        encode_entry("meta.policy.0", meta(agent=big))


def test_metadata_payload_must_be_json() -> None:
    with pytest.raises(ValueError, match="agent metadata is not JSON"):
        meta(agent="definitely not json")


# -- shards --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "shards"),
    [
        (1, 1),
        (2, 1),
        (128, 1),
        (129, 2),
        (256, 2),
        (257, 3),
        (1024, 8),
        (MAX_RANKS, 32),
    ],
)
def test_shards_needed(total: int, shards: int) -> None:
    assert shards_needed(total) == shards


@pytest.mark.parametrize("total", [0, -1, MAX_RANKS + 1])
def test_shards_needed_rejects_out_of_range(total: int) -> None:
    with pytest.raises(ValueError, match=f"total ranks {total} is outside"):
        shards_needed(total)


@pytest.mark.parametrize(
    ("role", "rank", "policy", "rollout", "shards", "shard"),
    [
        ("policy", 0, 2, 2, 1, 0),
        ("rollout", 1, 2, 2, 1, 0),
        ("policy", 99, 100, 100, 2, 0),
        ("rollout", 0, 100, 100, 2, 1),  # 200 ranks in 2 blocks of 100
        ("rollout", 99, 100, 100, 2, 1),
        ("policy", 127, 512, 512, 8, 0),
        ("policy", 128, 512, 512, 8, 1),
        ("rollout", 511, 512, 512, 8, 7),
        ("rollout", 0, 1, 1, 2, 1),  # more shards than needed is allowed
    ],
)
def test_shard_of(role: str, rank: int, policy: int, rollout: int, shards: int, shard: int) -> None:
    assert shard_of(role, rank, policy, rollout, shards) == shard  # type: ignore[arg-type]
    assert shard_of_key(meta_key(role, rank), policy, rollout, shards) == shard  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("role", "rank", "policy", "rollout", "shards", "error"),
    [
        ("policy", 2, 2, 2, 1, "policy rank 2 is outside world size 2"),
        ("rollout", -1, 2, 2, 1, "rollout rank -1 is outside"),
        ("policy", 0, 0, 2, 1, "world sizes must be >= 1"),
        ("policy", 0, 200, 200, 3, "shards=3 is too few for 400 ranks"),
        ("critic", 0, 2, 2, 1, "role 'critic'"),
    ],
)
def test_shard_of_rejects_bad_input(
    role: str, rank: int, policy: int, rollout: int, shards: int, error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        shard_of(role, rank, policy, rollout, shards)  # type: ignore[arg-type]


@given(policy=st.integers(1, 1500), rollout=st.integers(1, 1500), extra=st.integers(0, 3))
def test_shards_are_contiguous_and_within_capacity(policy: int, rollout: int, extra: int) -> None:
    shards = shards_needed(policy + rollout) + extra
    assigned = [shard_of("policy", r, policy, rollout, shards) for r in range(policy)]
    assigned += [shard_of("rollout", r, policy, rollout, shards) for r in range(rollout)]
    assert assigned == sorted(assigned)
    assert all(0 <= s < shards for s in assigned)
    assert max(assigned.count(s) for s in set(assigned)) <= RANKS_PER_SHARD


def test_barrier_and_notice_live_in_shard_zero() -> None:
    assert shard_of_key(BARRIER_KEY, 600, 600, 10) == 0
    assert shard_of_key(PREEMPT_KEY, 600, 600, 10) == 0


def test_full_shard_zero_fits_in_a_configmap() -> None:
    per_rank = (
        MAX_META_BYTES
        + len("meta.rollout.4095")
        + MAX_PROGRESS_BYTES
        + len("progress.rollout.4095")
    )
    worst = (
        RANKS_PER_SHARD * per_rank + max_value_bytes("barrier") + max_value_bytes("preempt") + 64
    )
    assert worst < SHARD_BUDGET_BYTES < 1 << 20
    uids = tuple("u" * MAX_UID_CHARS for _ in range(MAX_RANKS // 2))
    barrier = BarrierEntry(epoch=10**9, policy_uids=uids, rollout_uids=uids)
    assert len(encode_entry(BARRIER_KEY, barrier)) <= max_value_bytes("barrier")


@pytest.mark.parametrize(
    ("base", "shard", "name"),
    [
        ("job-rendezvous", 0, "job-rendezvous"),
        ("job-rendezvous", 1, "job-rendezvous-1"),
        ("job-rendezvous", 12, "job-rendezvous-12"),
    ],
)
def test_configmap_name(base: str, shard: int, name: str) -> None:
    assert configmap_name(base, shard) == name


@pytest.mark.parametrize(
    ("base", "shard", "error"),
    [
        ("", 0, "base name is empty"),
        ("job", -1, "shard -1 is negative"),
        ("x" * 253, 1, "longer than 253"),
    ],
)
def test_configmap_name_rejects_bad_input(base: str, shard: int, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        configmap_name(base, shard)


def test_merge_patch_sets_only_own_key() -> None:
    assert merge_patch("meta.policy.0", "{}") == {"data": {"meta.policy.0": "{}"}}
    with pytest.raises(ValueError, match="'a/b' is not a valid ConfigMap data key"):
        merge_patch("a/b", "{}")


# -- decisions -----------------------------------------------------------------------------


def test_snapshot_ignores_other_epochs_and_unknown_keys() -> None:
    data = published(2, 2, epoch=1)
    data[meta_key("rollout", 1)] = encode_entry(meta_key("rollout", 1), meta("rollout", 1, epoch=0))
    data["note.from.admin"] = "anything at all"
    snap = read_snapshot(data, 1, 2, 2)
    assert sorted(snap.meta) == [("policy", 0), ("policy", 1), ("rollout", 0)]
    assert not barrier_ready(snap, 2, 2)
    assert read_snapshot(data, 0, 2, 2).meta.keys() == {("rollout", 1)}


def test_snapshot_rejects_garbage_whatever_the_epoch() -> None:
    data = published(1, 1)
    data["progress.rollout.0"] = "{torn"
    with pytest.raises(EntryError, match=r"'progress\.rollout\.0': value is not JSON"):
        read_snapshot(data, 5, 1, 1)


def test_snapshot_rejects_ranks_outside_the_job() -> None:
    data = published(1, 1)
    data["meta.rollout.3"] = encode_entry("meta.rollout.3", meta("rollout", 3))
    with pytest.raises(EntryError, match=r"'meta\.rollout\.3': rank 3 is outside the rollout"):
        read_snapshot(data, 0, 1, 1)


def test_snapshot_rejects_barrier_of_another_shape() -> None:
    data = {
        BARRIER_KEY: encode_entry(
            BARRIER_KEY, BarrierEntry(epoch=0, policy_uids=("a",), rollout_uids=("b",))
        )
    }
    with pytest.raises(EntryError, match="lists 1 policy and 1 rollout ranks, the job has 2"):
        read_snapshot(data, 0, 2, 2)


@pytest.mark.parametrize(
    ("policy", "rollout", "drop", "ready"),
    [
        (2, 2, None, True),
        (2, 2, "meta.policy.1", False),
        (2, 2, "meta.rollout.0", False),
        (1, 3, None, True),
        (3, 1, "meta.rollout.0", False),
    ],
)
def test_barrier_ready(policy: int, rollout: int, drop: str | None, ready: bool) -> None:
    data = published(policy, rollout, epoch=4)
    if drop is not None:
        del data[drop]
    snap = read_snapshot(data, 4, policy, rollout)
    assert barrier_ready(snap, policy, rollout) is ready
    if ready:
        barrier = make_barrier(snap, policy, rollout)
        assert barrier.epoch == 4
        assert barrier.uid_of("rollout", rollout - 1) == f"uid-rollout-{rollout - 1}"
    else:
        with pytest.raises(ValueError, match=f"barrier of epoch 4 is not ready: missing {drop}"):
            make_barrier(snap, policy, rollout)


def test_barrier_ready_checks_pod_uids() -> None:
    snap = read_snapshot(published(1, 1), 0, 1, 1)
    uids = {("policy", 0): "uid-policy-0", ("rollout", 0): "uid-rollout-0"}
    assert barrier_ready(snap, 1, 1, pod_uids=uids)  # type: ignore[arg-type]
    uids[("rollout", 0)] = "someone-else"
    with pytest.raises(
        EntryError,
        match=r"'meta\.rollout\.0': written by pod uid "
        r"'uid-rollout-0', but the rank's pod is 'someone-else'",
    ):
        barrier_ready(snap, 1, 1, pod_uids=uids)  # type: ignore[arg-type]


def progress(
    rank: int,
    refits: int,
    seconds: float,
    nbytes: int,
    *,
    role: str = "rollout",
    state: str = "running",
    epoch: int = 0,
) -> tuple[str, str]:
    key = progress_key(role, rank)  # type: ignore[arg-type]
    entry = ProgressEntry(
        epoch=epoch,
        uid=f"u{rank}",
        role=role,
        rank=rank,  # type: ignore[arg-type]
        state=state,
        refits_completed=refits,  # type: ignore[arg-type]
        bytes_total=refits * nbytes,
        seconds_total=refits * seconds,
        recent=(RefitReport(refit=refits - 1, bytes=nbytes, seconds=seconds),) if refits else (),
    )
    return key, encode_entry(key, entry)


@pytest.mark.parametrize(
    ("rows", "refits", "total", "seconds", "gbps", "done", "preempted"),
    [
        ([], 0, 0, 0.0, 0.0, 0, 0),
        ([(0, 3, 0.5, 10**9), (1, 3, 1.0, 10**9)], 3, 6 * 10**9, 1.0, 2.0, 0, 0),
        ([(0, 3, 0.5, 10**9)], 0, 3 * 10**9, 0.5, 2.0, 0, 0),  # rank 1 silent
        ([(0, 2, 0.5, 10**9), (1, 3, 0.25, 10**9)], 2, 5 * 10**9, 0.5, 4.0, 0, 0),
        (
            [
                (0, 1, 2.0, 10**9, "policy", "done"),
                (0, 1, 2.0, 10**9, "rollout", "preempted"),
                (1, 1, 1.0, 10**9, "rollout", "done"),
            ],
            1,
            2 * 10**9,
            2.0,
            1.0,
            2,
            1,
        ),
    ],
)
def test_aggregate_progress(
    rows: list[tuple],
    refits: int,
    total: int,
    seconds: float,
    gbps: float,
    done: int,
    preempted: int,
) -> None:
    data = dict(
        progress(*row[:4], **dict(zip(("role", "state"), row[4:], strict=False))) for row in rows
    )
    data.update(dict([progress(0, 9, 9.0, 10**9, epoch=7)]) if not rows else {})
    summary = aggregate_progress(read_snapshot(data, 0, 1, 2), 1, 2)
    assert summary.refits_completed == refits
    assert summary.bytes_total == total
    assert summary.last_refit_seconds == seconds
    assert math.isclose(summary.last_refit_gbps, gbps)
    assert summary.ranks_done == done
    assert summary.ranks_preempted == preempted
    assert summary.ranks_reporting == len(rows)


def test_preempt_notice_of_epoch() -> None:
    notice = make_preempt_notice(3, "job-rollout-1", "uid-r1", "DisruptionTarget: eviction")
    data = {PREEMPT_KEY: encode_entry(PREEMPT_KEY, notice)}
    assert read_snapshot(data, 3, 1, 1).preempt == notice
    assert read_snapshot(data, 4, 1, 1).preempt is None
    with pytest.raises(ValueError, match="reason"):
        PreemptNotice(epoch=0, pod="p", uid="u", reason="")
