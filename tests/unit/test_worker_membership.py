"""What a rank decides from the membership (``refit_worker.following``): its standing, the
peer list for the engine, what a lingering policy still owes and when it may stop.  Pure:
entries as data."""

from __future__ import annotations

from refit_worker.contract.entries import (
    BarrierEntry,
    MetadataEntry,
    ProgressEntry,
    ProgressState,
    RolloutMember,
)
from refit_worker.following import (
    all_done,
    lacking,
    members,
    peer_metadata,
    standing,
)
from refit_worker.rendezvous import Member


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


def _progress(rank: int, uid: str, completed: int, state: ProgressState) -> ProgressEntry:
    return ProgressEntry(
        epoch=1, uid=uid, role="rollout", rank=rank, state=state, refits_completed=completed
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


def test_a_lingering_policy_owes_the_last_refit_to_members_without_it() -> None:
    barrier = _barrier(("a", 0), ("b", 1), ("c", 0))
    progress = {
        ("rollout", 0): _progress(0, "a", 4, "done"),
        # Rank 1's report is its replaced pod's: the new pod has not reported yet.
        ("rollout", 1): _progress(1, "b-old", 4, "done"),
        ("rollout", 2): _progress(2, "c", 2, "running"),
    }
    assert lacking(barrier, progress, refits=4) == {1, 2}
    assert not all_done(barrier, progress)
    progress[("rollout", 1)] = _progress(1, "b", 4, "done")
    progress[("rollout", 2)] = _progress(2, "c", 4, "done")
    assert lacking(barrier, progress, refits=4) == set()
    assert all_done(barrier, progress)


def test_an_empty_slot_is_done_only_when_its_last_pod_said_so() -> None:
    barrier = _barrier(("a", 0), None)
    progress = {("rollout", 0): _progress(0, "a", 4, "done")}
    assert lacking(barrier, progress, refits=4) == set()
    assert not all_done(barrier, progress)  # rank 1 never reported: a joiner is owed
    progress[("rollout", 1)] = _progress(1, "b", 2, "running")  # died mid-run
    assert not all_done(barrier, progress)
    # Finished and exited, and the coordinator dropped it from the membership.
    progress[("rollout", 1)] = _progress(1, "b", 4, "done")
    assert all_done(barrier, progress)


def test_an_empty_slot_held_for_a_later_generation_is_owed_whatever_its_old_pod_said() -> None:
    # Drained during the final commit: generation 0 finished it and said done, but its
    # slot was already handed to generation 1, which is still starting.
    progress = {
        ("rollout", 0): _progress(0, "a", 4, "done"),
        ("rollout", 1): _progress(1, "b", 4, "done"),
    }
    held = _barrier(("a", 0), None).model_copy(update={"generations": (0, 1)})
    assert not all_done(held, progress)
    # Its own generation's report (or a barrier that does not say) is the slot's word.
    progress[("rollout", 1)] = progress[("rollout", 1)].model_copy(update={"generation": 1})
    assert all_done(held, progress)
    assert all_done(_barrier(("a", 0), None), progress)


def test_all_have_counts_only_the_reports_of_the_pods_now_in_the_slots() -> None:
    from refit_worker.following import all_have

    progress = {
        ("rollout", 0): _progress(0, "a", 5, "running"),
        ("rollout", 1): _progress(1, "b-old", 9, "done"),  # the replaced pod's report
    }
    assert all_have({0: ("a", 0)}, progress, refit_id=4)
    assert not all_have({0: ("a", 0)}, progress, refit_id=5)
    assert not all_have({0: ("a", 0), 1: ("b", 1)}, progress, refit_id=4)
    assert not all_have({}, progress, refit_id=0)
