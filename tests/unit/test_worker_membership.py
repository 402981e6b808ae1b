"""What a rank decides from the membership (``refit_worker.session.following``): its standing and
the peer list for the engine (what a policy rank owes whom: ``test_owed.py``).  Pure:
entries as data."""

from __future__ import annotations

from refit_worker.contract.entries import (
    BarrierEntry,
    MetadataEntry,
    RolloutMember,
)
from refit_worker.rendezvous import Member
from refit_worker.session.following import members, peer_metadata, standing


def _barrier(*slots: tuple[str, int] | None, version: int = 1) -> BarrierEntry:
    return BarrierEntry(
        epoch=2,
        version=version,
        policy_uids=("p0",),
        rollout=tuple(
            None if s is None else RolloutMember(uid=s[0], generation=s[1]) for s in slots
        ),
    )


def _me(rank: int, uid: str, generation: int = 0) -> Member:
    return Member("rollout", rank, 2, uid, generation)


def _meta(role: str, rank: int, uid: str, generation: int = 0) -> MetadataEntry:
    return MetadataEntry(
        epoch=2,
        uid=uid,
        role=role,  # type: ignore[arg-type]
        rank=rank,
        generation=generation,
        agent=f'{{"name": "{uid}"}}',
    )


def test_standing_tells_member_waiting_removed_and_stale() -> None:
    barrier = _barrier(("a", 0), None, ("c", 1))
    assert standing(barrier, _me(0, "a")) == "member"
    assert standing(barrier, _me(1, "b")) == "waiting"  # not listed yet
    assert standing(barrier, _me(3, "d")) == "removed"  # past R = 3: a scale-down
    assert standing(barrier, _me(2, "old", 0)) == "superseded"  # generation 1 holds it
    # The same uid under an older generation is not the member either.
    assert standing(barrier, _me(2, "c", 0)) == "superseded"


def test_peer_metadata_lists_only_members_whose_entry_is_the_listed_pod() -> None:
    barrier = _barrier(("a", 0), None, ("c", 1), ("d", 0))
    meta = {
        ("policy", 0): _meta("policy", 0, "p0"),
        ("rollout", 0): _meta("rollout", 0, "a"),
        ("rollout", 1): _meta("rollout", 1, "b"),  # published, not a member (yet)
        ("rollout", 2): _meta("rollout", 2, "c", 0),  # the stale generation's entry
        ("rollout", 3): _meta("rollout", 3, "d"),
    }
    peers = peer_metadata(barrier, meta)
    assert peers == ['{"name": "p0"}', '{"name": "a"}', None, None, '{"name": "d"}']
    assert peer_metadata(barrier, meta, only={3}) == [
        '{"name": "p0"}',
        None,
        None,
        None,
        '{"name": "d"}',
    ]
    assert members(barrier) == {0: ("a", 0), 2: ("c", 1), 3: ("d", 0)}
