"""The pure membership decisions of the checkpoint engine (:mod:`.peers`,
:mod:`.delivery`) and the ``decline`` control message."""

from __future__ import annotations

import asyncio

import pytest

from refit_worker.engine import DeclinedError, PeerError, RefitTimeoutError
from refit_worker.engine.messages.wire import (
    BufferDesc,
    Decline,
    Manifest,
    ManifestEntry,
    NixlAgentMetadata,
    ProtocolError,
    decode,
    encode,
    parse_metadata,
)
from refit_worker.engine.policy.target_failures import Delivery, TargetDropped
from refit_worker.engine.transport.agent import WholeRefitWanted
from refit_worker.engine.transport.peers import (
    disagreement,
    expected_sources,
    plan_peer_update,
    targets_for_policy,
)


def meta(name: str, addr: int = 4096) -> NixlAgentMetadata:
    return NixlAgentMetadata(
        agent_name=name,
        agent_metadata=name.encode(),
        buffers=(BufferDesc(addr=addr, length=1 << 20), BufferDesc(addr=addr * 2, length=1 << 20)),
    )


P0, R0, R1, R1B = meta("p0"), meta("r0"), meta("r1"), meta("r1-new")


def test_only_changed_peers_of_the_other_role_are_removed_and_added() -> None:
    first = plan_peer_update(
        {}, [P0, R0, R1], role="policy", train_world_size=1, rollout_world_size=2
    )
    assert first.remove == () and [k for k, _ in first.add] == [("rollout", 0), ("rollout", 1)]
    current = dict(first.add)
    # Rank 1 is gone: only it is removed.
    gone = plan_peer_update(
        current, [P0, R0, None], role="policy", train_world_size=1, rollout_world_size=2
    )
    assert gone.remove == (("rollout", 1),) and gone.add == ()
    # A new agent under rank 1 replaces the old one; rank 0 is left alone.
    moved = plan_peer_update(
        current, [P0, R0, R1B], role="policy", train_world_size=1, rollout_world_size=2
    )
    assert moved.remove == (("rollout", 1),) and moved.add == ((("rollout", 1), R1B),)
    # Same agent, other buffers (it prepared again): reconnected.
    rebuffered = meta("r0", addr=8192)
    again = plan_peer_update(
        current, [P0, rebuffered, R1], role="policy", train_world_size=1, rollout_world_size=2
    )
    assert again.remove == (("rollout", 0),) and again.add == ((("rollout", 0), rebuffered),)
    # Nothing changed: nothing to do.
    same = plan_peer_update(
        current, [P0, R0, R1], role="policy", train_world_size=1, rollout_world_size=2
    )
    assert same.remove == same.add == ()


def test_a_rollout_rank_gets_a_whole_new_policy_after_a_restart() -> None:
    current = {("policy", 0): P0}
    new_p0, new_p1 = meta("p0-e2"), meta("p1-e2")
    update = plan_peer_update(
        current, [new_p0, new_p1, R0], role="rollout", train_world_size=2, rollout_world_size=1
    )
    assert update.remove == (("policy", 0),)
    assert update.add == ((("policy", 0), new_p0), (("policy", 1), new_p1))


def test_a_listing_of_the_wrong_length_or_with_a_name_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="3 entries for 1 policy and 1 rollout"):
        plan_peer_update({}, [P0, R0, R1], role="policy", train_world_size=1, rollout_world_size=1)
    with pytest.raises(ValueError, match=r"agent\(s\) \['r0'\] for more than one rank"):
        parse_metadata([P0, R0, R0], 3)
    assert parse_metadata([P0.model_dump_json(), None], 2) == [P0, None]


@pytest.mark.parametrize(
    ("rank", "T", "R", "members", "sharded", "want"),
    [
        (0, 1, 3, {0, 1, 2}, False, (0, 1, 2)),  # fan-out
        (0, 1, 3, {0, 2}, False, (0, 2)),  # rank 1 absent: the others keep their sources
        (1, 2, 4, {0, 1, 2, 3}, False, (1, 3)),  # fan-out from two senders
        (1, 2, 4, {0, 2}, False, ()),  # rank 1's targets are all absent
        (1, 4, 2, {0, 1}, False, (1,)),  # striping
        (1, 2, 3, {0, 2, 7}, True, (0, 2)),  # sharded: every member below R
    ],
)
def test_targets_follow_the_members_with_stable_indices(rank, T, R, members, sharded, want) -> None:
    got = targets_for_policy(
        rank, train_world_size=T, rollout_world_size=R, members=members, sharded=sharded
    )
    assert got == want


def test_expected_sources_unsharded_and_sharded() -> None:
    assert expected_sources(0, train_world_size=4, rollout_world_size=2) == (0, 2)
    assert expected_sources(1, train_world_size=1, rollout_world_size=3) == (0,)
    assert expected_sources(0, train_world_size=4, rollout_world_size=2, stripe=False) == (0,)
    sharded = expected_sources(1, train_world_size=2, rollout_world_size=2, sharded_senders=[0, 1])
    assert sharded == (1, 0)  # the manifest's first sender, then the plan's others
    with pytest.raises(ValueError, match="rollout_rank"):
        expected_sources(3, train_world_size=2, rollout_world_size=2)


def manifest(version: int = 1, R: int | None = 2, digest: str = "d") -> Manifest:
    return Manifest(
        refit=3,
        total_buckets=1,
        digest=digest,
        bucket_size=64,
        tensors=(ManifestEntry(name="w", dtype="float32", shape=(2,)),),
        version=version,
        rollout_world_size=R,
    )


def test_manifests_agree_only_when_all_came_and_match() -> None:
    assert disagreement({0: manifest(), 1: manifest()}) is None
    assert disagreement({0: manifest(), 1: None}) == "no manifest from policy rank(s) [1]"
    reason = disagreement({0: manifest(version=1), 1: manifest(version=2)})
    assert reason is not None and "different memberships" in reason
    assert "policy rank 0: version 1" in reason and "policy rank 1: version 2" in reason
    reason = disagreement({0: manifest(R=2), 1: manifest(R=3)})
    assert reason is not None and "R=3" in reason
    reason = disagreement({0: manifest(digest="a"), 1: manifest(digest="b")})
    assert reason is not None and "disagree on the weights" in reason


def test_decline_round_trips_and_the_old_protocol_is_refused_by_version() -> None:
    decline = Decline(refit=4, reason="rollout rank 0: it waits for refit 5 or later")
    assert decode(encode(decline)) == decline
    assert decode(encode(manifest(version=7))).version == 7  # type: ignore[union-attr]
    # 5: the last version before seals, whose senders cannot sign.
    with pytest.raises(ProtocolError, match="protocol version 5, this worker speaks version 6"):
        decode(b'RFT1{"v":5,"kind":"credit","refit":0,"seq":0,"buffer":0}')


async def test_delivery_drops_a_failing_target_and_keeps_the_first_reason() -> None:
    delivery = Delivery()

    async def fails() -> None:
        raise PeerError("rollout rank 1 gone")

    async def times_out() -> None:
        raise RefitTimeoutError("no credit")

    async def works() -> int:
        return 7

    assert await delivery.attempt(0, works()) == 7
    assert await delivery.attempt(1, fails()) is None
    assert await delivery.attempt(1, times_out()) is None
    assert delivery.dropped == {1: "PeerError: rollout rank 1 gone"}
    delivery.drop(2, "left the membership")
    with pytest.raises(TargetDropped, match="left the membership"):
        delivery.check(2)
    assert delivery.delivered([0, 1, 2]) == (0,)


async def test_delivery_lets_this_ranks_own_errors_through() -> None:
    async def own() -> None:
        raise ValueError("bad layout")

    with pytest.raises(ValueError, match="bad layout"):
        await Delivery().attempt(0, own())
    await asyncio.sleep(0)


async def test_a_target_that_wants_the_refit_whole_is_dropped_and_listed_for_it() -> None:
    delivery = Delivery()

    async def declines_the_delta() -> None:
        raise WholeRefitWanted("rollout rank 2 serves refit 3, the delta is onto refit 4")

    async def declines() -> None:
        raise DeclinedError("rollout rank 1 waits for refit 9")

    assert await delivery.attempt(2, declines_the_delta()) is None
    assert await delivery.attempt(1, declines()) is None
    assert delivery.wants_whole == {2} and set(delivery.dropped) == {1, 2}
