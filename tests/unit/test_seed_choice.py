"""Peer seeding's decisions, no NIXL: which peers a new rollout pod may seed from, how the
tensors are split over them, and how a seed manifest read mid-rewrite is told apart."""

from __future__ import annotations

import base64

import pytest

from refit_worker.contract.entries import (
    BarrierEntry,
    MetadataEntry,
    ProgressEntry,
    RolloutMember,
    SeedPointer,
    SeedReport,
    encode_entry,
)
from refit_worker.engine.messages.wire import LandingSet, NixlAgentMetadata
from refit_worker.engine.rollout.seed_transfer import (
    SeedError,
    SeedManifest,
    SeedTensor,
    _agreeing,
    decode_manifest,
    encode_manifest,
    stripes,
)
from refit_worker.policy.owed import seeding_peer
from refit_worker.rendezvous import Member
from refit_worker.rollout.seed_choice import policy_done, predecessor, seed_sources, successor

_AGENT = NixlAgentMetadata(agent_name="a", agent_metadata=b"x").model_dump_json()
_POINTER = SeedPointer(addr=4096, nbytes=512, metadata=base64.b64encode(b"m").decode())


def _barrier(*uids: str | None) -> BarrierEntry:
    return BarrierEntry(
        epoch=0,
        policy_uids=("p0",),
        rollout=tuple(None if u is None else RolloutMember(uid=u) for u in uids),
    )


def _meta(rank: int, uid: str, *, seed: SeedPointer | None = _POINTER) -> MetadataEntry:
    return MetadataEntry(epoch=0, uid=uid, role="rollout", rank=rank, agent=_AGENT, seed=seed)


def _progress(rank: int, uid: str, done: int, state: str = "running") -> ProgressEntry:
    return ProgressEntry.model_validate(
        {
            "epoch": 0,
            "uid": uid,
            "role": "rollout",
            "rank": rank,
            "state": state,
            "refits_completed": done,
        }
    )


def test_the_peers_with_the_newest_commit_come_first_and_self_is_left_out() -> None:
    barrier = _barrier("new", "u1", "u2", "u3")
    meta = {("rollout", r): _meta(r, u) for r, u in enumerate(["new", "u1", "u2", "u3"])}
    progress = {
        ("rollout", 1): _progress(1, "u1", 5),
        ("rollout", 2): _progress(2, "u2", 6),
        ("rollout", 3): _progress(3, "u3", 6, state="done"),
    }
    found = seed_sources(barrier, meta, progress, me=0, min_refit=3)
    assert [s.label for s in found] == ["rollout-2", "rollout-3", "rollout-1"]
    assert found[0].region == (4096, 512, 0)
    assert found[0].region_metadata == b"m"


def test_only_a_peer_holding_the_same_part_is_a_source() -> None:
    # Tensor-parallel workers 0 and 1 hold other rows of tensors of the same shapes.
    part = {"tp_rank": 1, "tp_size": 2, "slices": {"w": [0, 4, 8]}}
    other = {**part, "tp_rank": 0, "slices": {"w": [0, 0, 4]}}
    barrier = _barrier("new", "u1", "u2")
    meta = {
        ("rollout", r): _meta(r, u).model_copy(
            update={
                "agent": NixlAgentMetadata(
                    agent_name="a", agent_metadata=b"x", layout=lay
                ).model_dump_json()
            }
        )
        for r, u, lay in [(1, "u1", other), (2, "u2", part)]
    }
    progress = {("rollout", r): _progress(r, u, 6) for r, u in [(1, "u1"), (2, "u2")]}
    found = seed_sources(barrier, meta, progress, me=0, min_refit=3, layout=part)
    assert [s.label for s in found] == ["rollout-2"]
    assert seed_sources(barrier, meta, progress, me=0, min_refit=3) == []


@pytest.mark.parametrize(
    ("why", "meta", "progress", "barrier_uid"),
    [
        ("no offer", _meta(1, "u1", seed=None), _progress(1, "u1", 6), "u1"),
        (
            "a stale pod's metadata",
            _meta(
                1,
                "old",
            ),
            _progress(1, "u1", 6),
            "u1",
        ),
        ("a stale pod's progress", _meta(1, "u1"), _progress(1, "old", 6), "u1"),
        ("not a member now", _meta(1, "u1"), _progress(1, "u1", 6), None),
        ("nothing new enough", _meta(1, "u1"), _progress(1, "u1", 3), "u1"),
        ("failed", _meta(1, "u1"), _progress(1, "u1", 6, state="failed"), "u1"),
        ("preempted", _meta(1, "u1"), _progress(1, "u1", 6, state="preempted"), "u1"),
    ],
)
def test_a_peer_that_cannot_give_a_current_commit_is_not_a_source(
    why: str, meta: MetadataEntry, progress: ProgressEntry, barrier_uid: str | None
) -> None:
    found = seed_sources(
        _barrier("new", barrier_uid),
        {("rollout", 1): meta},
        {("rollout", 1): progress},
        me=0,
        min_refit=3,
    )
    assert found == [], why


def test_stripes_balance_bytes_over_peers_and_place_every_tensor_once() -> None:
    sizes = {"a": 100, "b": 60, "c": 50, "d": 40, "e": 10}
    shares = stripes(sizes, 2)
    assert sorted(n for share in shares for n in share) == sorted(sizes)
    loads = [sum(sizes[n] for n in share) for share in shares]
    assert max(loads) - min(loads) <= 20
    assert stripes(sizes, 1) == [["a", "b", "c", "d", "e"]]
    assert stripes({"a": 5}, 3) == [["a"], [], []]


def _manifest(refit: int, hashes: tuple[int, ...] = (1, 2)) -> SeedManifest:
    return SeedManifest(
        refit=refit,
        algorithm="xxh3_64",
        tensors=tuple(
            SeedTensor(name=f"t{i}", dtype="bfloat16", shape=(2, 2), hash=h)
            for i, h in enumerate(hashes)
        ),
        landing=LandingSet(id="s", metadata=b"m", tensors=()),
    )


def test_a_manifest_round_trips_and_a_torn_one_is_refused() -> None:
    raw = encode_manifest(_manifest(4))
    assert decode_manifest(raw + b"\0" * 64, "peer").refit == 4
    torn = bytearray(raw)
    torn[-5] ^= 0xFF  # a byte of the body changed after its hash was written
    with pytest.raises(SeedError, match="torn"):
        decode_manifest(bytes(torn), "peer")
    with pytest.raises(SeedError, match="torn"):
        decode_manifest(b"\0" * 64, "peer")  # offered, never written
    with pytest.raises(SeedError, match="no manifest"):
        decode_manifest(b"\0" * 4, "peer")


def test_only_peers_agreeing_on_the_newest_refit_are_read_from() -> None:
    src = [object(), object(), object(), object()]
    offers = [
        (src[0], _manifest(5)),
        (src[1], _manifest(6)),
        (src[2], _manifest(6, hashes=(1, 9))),  # same refit, other bytes: not mixed in
        (src[3], _manifest(6)),
    ]
    chosen = _agreeing(offers, 3)  # type: ignore[arg-type]
    assert [s for s, _ in chosen] == [src[1], src[3]]
    assert _agreeing(offers, 7) == []  # type: ignore[arg-type]


def _report(role: str, rank: int, uid: str, done: int, state: str, seeding: bool) -> ProgressEntry:
    return ProgressEntry.model_validate(
        {
            "epoch": 0,
            "uid": uid,
            "role": role,
            "rank": rank,
            "state": state,
            "refits_completed": done,
            "seeding": seeding,
        }
    )


def test_a_policy_rank_stops_lingering_only_for_a_member_that_stays_with_the_last_refit() -> None:
    barrier = _barrier("u0", "u1")
    last = 5
    staying = {("rollout", 1): _report("rollout", 1, "u1", 6, "done", True)}
    assert seeding_peer(barrier, staying, last) == 1
    gone_pod = {("rollout", 1): _report("rollout", 1, "old", 6, "done", True)}
    older = {("rollout", 1): _report("rollout", 1, "u1", 5, "running", True)}
    not_staying = {("rollout", 1): _report("rollout", 1, "u1", 6, "done", False)}
    for progress in (gone_pod, older, not_staying, {}):
        assert seeding_peer(barrier, progress, last) is None


def test_the_policy_is_done_only_when_every_rank_sent_all_and_none_stays() -> None:
    barrier = BarrierEntry(epoch=0, policy_uids=("p0", "p1"), rollout=(None,))
    done = {("policy", r): _report("policy", r, f"p{r}", 4, "done", False) for r in (0, 1)}
    assert policy_done(barrier, done, 4)
    lingering = {**done, ("policy", 1): _report("policy", 1, "p1", 4, "done", True)}
    running = {**done, ("policy", 1): _report("policy", 1, "p1", 3, "running", False)}
    stale = {**done, ("policy", 1): _report("policy", 1, "other", 4, "done", False)}
    for progress in (lingering, running, stale, {("policy", 0): done[("policy", 0)]}):
        assert not policy_done(barrier, progress, 4)


def _data(meta: MetadataEntry, report: ProgressEntry) -> dict[str, str]:
    return {
        "meta.rollout.0": encode_entry("meta.rollout.0", meta),
        "progress.rollout.0": encode_entry("progress.rollout.0", report),
    }


def test_a_replacement_finds_the_offer_of_the_pod_it_replaces_and_nothing_else() -> None:
    old = MetadataEntry(epoch=0, uid="old", role="rollout", rank=0, agent=_AGENT, seed=_POINTER)
    found = predecessor(_data(old, _progress(0, "old", 4)), 0, "new", 1)
    assert found is not None and found[0] == 4 and found[1].label == "rollout-0-g0"
    no_offer = old.model_copy(update={"seed": None})
    assert predecessor(_data(no_offer, _progress(0, "old", 4)), 0, "new", 1) is None
    assert predecessor(_data(old, _progress(0, "old", 0)), 0, "new", 1) is None  # nothing
    assert predecessor(_data(old, _progress(0, "other", 4)), 0, "new", 1) is None
    assert predecessor(_data(old, _progress(0, "old", 4)), 0, "old", 0) is None  # itself
    assert predecessor({}, 0, "new", 1) is None


def test_a_drained_pod_hands_over_only_to_a_newer_pod_of_its_slot_that_serves() -> None:
    me = Member(role="rollout", rank=0, uid="old", epoch=0, generation=0)
    seed = SeedReport(source="rollout-0-g0", refit=3, bytes=8, seconds=0.1, serving_s=2.0)

    def report(uid: str, generation: int, seed: SeedReport | None) -> ProgressEntry:
        return ProgressEntry(
            epoch=0, uid=uid, role="rollout", rank=0, generation=generation, seed=seed
        )

    assert successor(report("new", 1, seed), me)
    assert not successor(report("new", 1, None), me)  # not serving yet
    assert not successor(report("old", 0, seed), me)  # its own report
