"""Unit tests of the pure rendezvous protocol: keys, entries, shards, decisions.

Nothing is emulated and nothing runs: these are pure functions over tables.
"""

from __future__ import annotations

import json
import math

import pytest

from refit_worker.contract.membership import slot_member
from refit_worker.contract.rendezvous import (
    BARRIER_KEY,
    MAX_GENERATION,
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
    LivePod,
    MetadataEntry,
    PreemptNotice,
    ProgressEntry,
    RefitReport,
    RolloutMember,
    aggregate_progress,
    decode_entry,
    encode_entry,
    is_valid_data_key,
    make_preempt_notice,
    max_value_bytes,
    membership,
    merge_patch,
    meta_key,
    parse_key,
    progress_key,
    read_snapshot,
)

AGENT = json.dumps({"name": "policy-0", "metadata": "QUJD" * 150, "buffers": [[1, 2, 0]]})


def meta(
    role: str = "policy",
    rank: int = 0,
    epoch: int = 0,
    uid: str = "uid-p0",
    agent: str = AGENT,
    generation: int = 0,
) -> MetadataEntry:
    return MetadataEntry(
        epoch=epoch,
        uid=uid,
        role=role,  # type: ignore[arg-type]
        rank=rank,
        agent=agent,
        generation=generation,
    )


def slots(*uids: str | None) -> tuple[RolloutMember | None, ...]:
    """Membership slots of generation 0 (None: an empty slot)."""
    return tuple(None if uid is None else RolloutMember(uid=uid) for uid in uids)


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
        (
            BARRIER_KEY,
            BarrierEntry(
                epoch=1,
                version=4,
                policy_uids=("a",),
                rollout=(RolloutMember(uid="b", generation=2), None),
            ),
        ),
        (PREEMPT_KEY, make_preempt_notice(1, "job-rollout-0", "u1", "DisruptionTarget")),
        (PREEMPT_KEY, make_preempt_notice(1, "job-policy-0", "u1", "drain", role="policy")),
        ("meta.rollout.3", meta("rollout", 3, uid="r3", generation=5)),
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
        encode_entry(PREEMPT_KEY, BarrierEntry(epoch=0, policy_uids=("a",), rollout=slots("b")))
    big = json.dumps({"blob": "x" * MAX_META_BYTES})
    with pytest.raises(EntryError, match=f"over the {MAX_META_BYTES}-byte limit"):
        encode_entry("meta.policy.0", meta(agent=big))


def test_metadata_payload_must_be_json() -> None:
    with pytest.raises(ValueError, match="agent metadata is not JSON"):
        meta(agent="definitely not json")


# -- shards (placement: test_rendezvous_shards.py) ---------------------------------------


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
    full = RolloutMember(uid="u" * MAX_UID_CHARS, generation=MAX_GENERATION)
    barrier = BarrierEntry(
        epoch=10**9,
        version=10**9,
        policy_uids=uids,
        rollout=(full,) * (MAX_RANKS - len(uids)),
        generations=(MAX_GENERATION,) * (MAX_RANKS - len(uids)),
    )
    assert len(encode_entry(BARRIER_KEY, barrier)) <= max_value_bytes("barrier")
    # The most rollout slots there may be fit too: the limit holds for any split.
    barrier = barrier.model_copy(
        update={
            "policy_uids": uids[:1],
            "rollout": (full,) * 4095,
            "generations": (MAX_GENERATION,) * 4095,
        }
    )
    assert len(encode_entry(BARRIER_KEY, barrier)) <= max_value_bytes("barrier")
    with pytest.raises(ValueError, match=f"over {MAX_RANKS}"):
        BarrierEntry(epoch=0, policy_uids=uids[:1], rollout=(full,) * MAX_RANKS)


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
    assert read_snapshot(data, 0, 2, 2).meta.keys() == {("rollout", 1)}


def test_snapshot_keeps_rollout_progress_of_any_epoch() -> None:
    data = dict([progress(0, 5, 1.0, 10, epoch=3), progress(0, 1, 1.0, 10, role="policy")])
    snap = read_snapshot(data, 4, 1, 1)
    assert snap.progress[("rollout", 0)].refits_completed == 5  # carried across epochs
    assert ("policy", 0) not in snap.progress  # a policy report of epoch 0 is not epoch 4's


def test_snapshot_rejects_garbage_whatever_the_epoch() -> None:
    data = published(1, 1)
    data["progress.rollout.0"] = "{torn"
    with pytest.raises(EntryError, match=r"'progress\.rollout\.0': value is not JSON"):
        read_snapshot(data, 5, 1, 1)
    data = published(1, 1)
    data["meta.rollout.7"] = "{torn"  # past R, but garbage all the same
    with pytest.raises(EntryError, match=r"'meta\.rollout\.7': value is not JSON"):
        read_snapshot(data, 0, 1, 1)


def test_snapshot_ignores_ranks_past_the_world_sizes() -> None:
    data = published(1, 1)
    data["meta.rollout.3"] = encode_entry("meta.rollout.3", meta("rollout", 3))
    data.update([progress(3, 9, 1.0, 10)])
    snap = read_snapshot(data, 0, 1, 1)
    assert sorted(snap.meta) == [("policy", 0), ("rollout", 0)]
    assert snap.progress == {}


def test_snapshot_rejects_barrier_of_another_policy_size() -> None:
    data = {
        BARRIER_KEY: encode_entry(
            BARRIER_KEY, BarrierEntry(epoch=0, policy_uids=("a",), rollout=slots("b"))
        )
    }
    with pytest.raises(EntryError, match="lists 1 policy ranks, the job has 2"):
        read_snapshot(data, 0, 2, 2)
    # Another R is no error: the coordinator rewrites the membership for the new R.
    assert read_snapshot(data, 0, 1, 5).barrier is not None


def test_barrier_membership_queries() -> None:
    barrier = BarrierEntry(
        epoch=2,
        version=3,
        policy_uids=("p0", "p1"),
        rollout=(RolloutMember(uid="r0", generation=1), None, RolloutMember(uid="r2")),
    )
    assert (barrier.policy_world_size, barrier.rollout_world_size) == (2, 3)
    assert barrier.members() == (0, 2)
    assert barrier.is_member("rollout", 0, "r0", 1)
    assert not barrier.is_member("rollout", 0, "r0", 0)  # the replaced generation
    assert not barrier.is_member("rollout", 0, "other", 1)  # another pod
    assert not barrier.is_member("rollout", 1, "r1", 0)  # an empty slot
    assert not barrier.is_member("rollout", 3, "r3", 0)  # past R
    assert barrier.is_member("policy", 1, "p1")
    assert not barrier.is_member("policy", 2, "p2")
    assert barrier.holder("rollout", 1) is None
    assert barrier.holder("policy", 0) == RolloutMember(uid="p0")


def live_pods(
    policy: int, rollout: int, **changes: LivePod | None
) -> dict[tuple[str, int], LivePod]:
    """The live pods of ``published``'s ranks; ``rollout_1=None`` drops rollout rank 1,
    ``rollout_1=LivePod(...)`` puts another pod there."""
    pods = {("policy", r): LivePod(f"uid-policy-{r}") for r in range(policy)}
    pods.update({("rollout", r): LivePod(f"uid-rollout-{r}") for r in range(rollout)})
    for name, pod in changes.items():
        role, rank = name.split("_")
        if pod is None:
            del pods[(role, int(rank))]
        else:
            pods[(role, int(rank))] = pod
    return pods  # type: ignore[return-value]


def decide(
    data: dict[str, str],
    live: dict[tuple[str, int], LivePod],
    previous: BarrierEntry | None = None,
    *,
    epoch: int = 0,
    world: tuple[int, int] = (2, 2),
) -> BarrierEntry | None:
    snap = read_snapshot(data, epoch, *world)
    return membership(snap, *world, live, previous)  # type: ignore[arg-type]


def test_membership_opens_once_every_running_rank_published() -> None:
    data = published(2, 2, epoch=4)
    barrier = decide(data, live_pods(2, 2), epoch=4)
    assert barrier == BarrierEntry(
        epoch=4,
        version=1,
        policy_uids=("uid-policy-0", "uid-policy-1"),
        rollout=slots("uid-rollout-0", "uid-rollout-1"),
        generations=(0, 0),
    )
    for missing in ("meta.policy.1", "meta.rollout.0"):
        partial = {k: v for k, v in data.items() if k != missing}
        assert decide(partial, live_pods(2, 2), epoch=4) is None


def test_membership_first_opening_rules() -> None:
    data = published(2, 2)
    # A rollout rank with no pod, or with a pod still pending, is not waited for.
    assert decide({k: v for k, v in data.items() if k != "meta.rollout.1"}, live_pods(2, 1)) == (
        BarrierEntry(
            epoch=0,
            policy_uids=("uid-policy-0", "uid-policy-1"),
            rollout=slots("uid-rollout-0", None),
            generations=(0, 0),
        )
    )
    pending = live_pods(2, 2, rollout_1=LivePod("uid-new", running=False))
    assert decide(data, pending).rollout == slots("uid-rollout-0", None)  # type: ignore[union-attr]
    # ... but a running one is, and so is every policy rank.
    running = live_pods(2, 2, rollout_1=LivePod("uid-new"))
    assert decide(data, running) is None
    assert decide(data, live_pods(2, 2, policy_1=None)) is None
    # No rollout member at all: nothing to refit to yet.
    policy_only = {k: v for k, v in data.items() if k.startswith("meta.policy")}
    assert decide(policy_only, live_pods(2, 0)) is None


def test_membership_refuses_a_policy_entry_by_another_pod() -> None:
    with pytest.raises(
        EntryError,
        match=r"'meta\.policy\.1': written by pod uid 'uid-policy-1', "
        r"but the rank's pod is 'someone-else'",
    ):
        decide(published(2, 2), live_pods(2, 2, policy_1=LivePod("someone-else")))


def test_membership_rewrites_with_a_version_bump_on_loss_join_and_scale() -> None:
    data = published(2, 2)
    first = decide(data, live_pods(2, 2))
    assert first is not None and first.version == 1
    assert decide(data, live_pods(2, 2), first) is first  # nothing changed: no rewrite
    # Rollout rank 1 is lost: its slot empties, the policy gang stays.
    lost = decide(data, live_pods(2, 1), first)
    assert lost is not None
    assert (lost.version, lost.rollout, lost.policy_uids) == (
        2,
        slots("uid-rollout-0", None),
        first.policy_uids,
    )
    assert lost.generations == (0, 0)
    # Its replacement (generation 1) runs: no member until it publishes as itself, but
    # the slot is now held for generation 1 (rewritten once, so a policy rank knows the
    # slot's last report, generation 0's, is no longer its word) ...
    new = LivePod("uid-rollout-1b", generation=1)
    coming = decide(data, live_pods(2, 2, rollout_1=new), lost)
    assert coming is not None and (coming.version, coming.rollout) == (3, lost.rollout)
    assert coming.generations == (0, 1) and coming.generation_of(1) == 1
    assert decide(data, live_pods(2, 2, rollout_1=new), coming) is coming
    key = meta_key("rollout", 1)
    data[key] = encode_entry(key, meta("rollout", 1, uid="uid-rollout-1b", generation=1))
    joined = decide(data, live_pods(2, 2, rollout_1=new), coming)
    assert joined is not None and joined.version == 4
    assert joined.rollout[1] == RolloutMember(uid="uid-rollout-1b", generation=1)
    # Once its pod is gone (deleted, no pod in the slot) the slot keeps its generation.
    gone = decide(data, live_pods(2, 1), joined)
    assert gone is not None and gone.rollout[1] is None and gone.generations == (0, 1)
    # Scale up to 3: a slot for rank 2, empty until it publishes; then down to 1.
    up = decide(data, live_pods(2, 3, rollout_1=new), joined, world=(2, 3))
    assert up is not None and (up.version, up.rollout_world_size) == (5, 3)
    assert up.rollout[2] is None
    down = decide(data, live_pods(2, 3, rollout_1=new), up, world=(2, 1))
    assert down is not None and (down.version, down.rollout) == (6, slots("uid-rollout-0"))


def test_membership_stale_pods_are_not_members() -> None:
    data = published(2, 2)
    first = decide(data, live_pods(2, 2))
    # The same uid of an older generation, or another uid of the same generation.
    for stale in (LivePod("uid-rollout-1", generation=1), LivePod("uid-other")):
        barrier = decide(data, live_pods(2, 2, rollout_1=stale), first)
        assert barrier is not None and barrier.rollout[1] is None
        assert not barrier.is_member("rollout", 1, "uid-rollout-1", 0)


@pytest.mark.parametrize(
    ("entry", "pod", "member"),
    [
        ("own", LivePod("u", 1), RolloutMember(uid="u", generation=1)),
        ("own", LivePod("u", 1, running=False), None),  # left / finished: not a member
        ("own", None, None),  # no pod holds the rank
        (None, LivePod("u", 1), None),  # not published (for this epoch)
        ("own", LivePod("u", 2), None),  # the same uid of another generation
        ("own", LivePod("other", 1), None),  # another pod's rank now
    ],
)
def test_a_slot_is_held_by_its_running_pod_when_the_meta_is_its_own(
    entry: str | None, pod: LivePod | None, member: RolloutMember | None
) -> None:
    written = None if entry is None else meta("rollout", 0, uid="u", generation=1)
    assert slot_member(written, pod) == member


@pytest.mark.parametrize(
    ("state", "uid", "generation", "member"),
    [
        ("left", "u", 1, None),  # left, still exiting: takes no more refits
        ("running", "u", 1, RolloutMember(uid="u", generation=1)),
        ("left", "u", 0, RolloutMember(uid="u", generation=1)),  # an older generation left
        ("left", "other", 1, RolloutMember(uid="u", generation=1)),  # another pod left
    ],
)
def test_a_running_pod_that_reported_left_holds_no_slot(
    state: str, uid: str, generation: int, member: RolloutMember | None
) -> None:
    written = meta("rollout", 0, uid="u", generation=1)
    report = ProgressEntry(
        epoch=0,
        uid=uid,
        generation=generation,
        role="rollout",
        rank=0,
        state=state,  # type: ignore[arg-type]
    )
    assert slot_member(written, LivePod("u", 1), report) == member


def test_a_scale_back_up_does_not_list_a_pod_that_left() -> None:
    data = published(2, 3)
    first = decide(data, live_pods(2, 3), world=(2, 3))
    down = decide(data, live_pods(2, 3), first, world=(2, 1))
    assert down is not None and down.rollout == slots("uid-rollout-0")
    # Ranks 1 and 2 reported "left" and exited; their pods (Succeeded) are still listed
    # when the scale back up comes, their meta of the epoch still in the map.
    exited = live_pods(
        2,
        3,
        rollout_1=LivePod("uid-rollout-1", running=False),
        rollout_2=LivePod("uid-rollout-2", running=False),
    )
    up = decide(data, exited, down, world=(2, 3))
    assert up is not None and up.rollout == slots("uid-rollout-0", None, None)


def test_a_scale_back_up_does_not_list_a_pod_that_left_and_is_still_exiting() -> None:
    data = published(2, 3)
    first = decide(data, live_pods(2, 3), world=(2, 3))
    down = decide(data, live_pods(2, 3), first, world=(2, 1))
    # Ranks 1 and 2 reported "left" but their processes are still exiting (pods Running).
    for rank in (1, 2):
        key = progress_key("rollout", rank)
        left = ProgressEntry(
            epoch=0, uid=f"uid-rollout-{rank}", role="rollout", rank=rank, state="left"
        )
        data[key] = encode_entry(key, left)
    up = decide(data, live_pods(2, 3), down, world=(2, 3))
    assert up is not None and up.rollout == slots("uid-rollout-0", None, None)
    # Their replacements (new uids, next generation) publish and are listed.
    for rank in (1, 2):
        key = meta_key("rollout", rank)
        data[key] = encode_entry(key, meta("rollout", rank, uid=f"uid-new-{rank}", generation=1))
    replaced = live_pods(2, 3, rollout_1=LivePod("uid-new-1", 1), rollout_2=LivePod("uid-new-2", 1))
    again = decide(data, replaced, up, world=(2, 3))
    assert again is not None
    assert [m and m.uid for m in again.rollout] == ["uid-rollout-0", "uid-new-1", "uid-new-2"]


def test_membership_of_a_new_epoch_needs_the_rollout_meta_rewritten() -> None:
    data = published(2, 2, epoch=0)
    old = decide(data, live_pods(2, 2))
    assert old is not None
    # Policy gang of epoch 1 published; rollout ranks still have epoch-0 meta.
    for rank in range(2):
        key = meta_key("policy", rank)
        data[key] = encode_entry(key, meta("policy", rank, epoch=1, uid=f"uid-policy-{rank}"))
    assert decide(data, live_pods(2, 2), old, epoch=1) is None
    key = meta_key("rollout", 0)
    data[key] = encode_entry(key, meta("rollout", 0, epoch=1, uid="uid-rollout-0"))
    assert decide(data, live_pods(2, 2), old, epoch=1) is None  # rank 1 runs: waited for
    key = meta_key("rollout", 1)
    data[key] = encode_entry(key, meta("rollout", 1, epoch=1, uid="uid-rollout-1"))
    new = decide(data, live_pods(2, 2), old, epoch=1)
    assert new is not None and (new.epoch, new.version) == (1, 1)


def test_membership_ignores_ranks_past_r() -> None:
    data = published(2, 3)  # rank 2 is left over from before a scale-down to 2
    barrier = decide(data, live_pods(2, 3), world=(2, 2))
    assert barrier is not None and barrier.rollout == slots("uid-rollout-0", "uid-rollout-1")


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
    # A policy report of another epoch is not this epoch's.
    data.update(dict([progress(0, 9, 9.0, 10**9, role="policy", epoch=7)]) if not rows else {})
    summary = aggregate_progress(read_snapshot(data, 0, 1, 2), 1, 2)
    assert summary.refits_completed == refits
    assert summary.bytes_total == total
    assert summary.last_refit_seconds == seconds
    assert math.isclose(summary.last_refit_gbps, gbps)
    assert summary.ranks_done == done
    assert summary.ranks_preempted == preempted
    assert summary.ranks_reporting == len(rows)


def test_aggregate_progress_counts_the_live_pods_of_the_slots() -> None:
    data = dict([progress(0, 4, 1.0, 10), progress(1, 6, 1.0, 10, epoch=3), progress(2, 9, 1, 10)])
    snap = read_snapshot(data, 5, 1, 2)  # rank 2 is past R; rank 1 reported in epoch 3
    assert aggregate_progress(snap, 1, 2).refits_completed == 4
    assert aggregate_progress(snap, 1, 2).ranks_reporting == 2
    # Rank 1's pod was replaced: the old pod's report is not the slot's.
    live = {("rollout", 0): LivePod("u0"), ("rollout", 1): LivePod("u1-new", generation=1)}
    summary = aggregate_progress(snap, 1, 2, live)  # type: ignore[arg-type]
    assert (summary.refits_completed, summary.ranks_reporting, summary.bytes_total) == (0, 1, 40)
    live[("rollout", 1)] = LivePod("u1")
    assert aggregate_progress(snap, 1, 2, live).refits_completed == 4  # type: ignore[arg-type]
    # No pod holds slot 1 (its pod finished and was deleted): its report stays on record.
    del live[("rollout", 1)]
    assert aggregate_progress(snap, 1, 2, live).refits_completed == 4  # type: ignore[arg-type]


def test_preempt_notice_of_epoch() -> None:
    notice = make_preempt_notice(3, "job-rollout-1", "uid-r1", "DisruptionTarget: eviction")
    data = {PREEMPT_KEY: encode_entry(PREEMPT_KEY, notice)}
    assert read_snapshot(data, 3, 1, 1).preempt == notice
    assert read_snapshot(data, 4, 1, 1).preempt is None
    with pytest.raises(ValueError, match="reason"):
        PreemptNotice(epoch=0, pod="p", uid="u", reason="")


def test_preempt_notice_role() -> None:
    everyone = make_preempt_notice(0, "job-rollout-1", "u", "eviction")
    policy = make_preempt_notice(0, "job-policy-0-e0", "u", "drain", role="policy")
    assert everyone.stops("policy") and everyone.stops("rollout")
    assert policy.stops("policy") and not policy.stops("rollout")
    assert json.loads(encode_entry(PREEMPT_KEY, policy))["role"] == "policy"
    with pytest.raises(ValueError, match="role"):
        PreemptNotice(epoch=0, pod="p", uid="u", reason="r", role="rollout")  # type: ignore[arg-type]


def test_progress_left_and_generation_round_trip() -> None:
    entry = ProgressEntry(epoch=1, uid="u", role="rollout", rank=2, generation=3, state="left")
    assert decode_entry("progress.rollout.2", encode_entry("progress.rollout.2", entry)) == entry
    with pytest.raises(ValueError, match="generation"):
        ProgressEntry(epoch=1, uid="u", role="rollout", rank=2, generation=-1)
