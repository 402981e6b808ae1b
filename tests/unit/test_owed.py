"""What a policy rank owes each rollout member (``refit_worker.policy.owed``), the one input of
the serve loop: a refit's send, its re-send by a new plan and the linger after the last
refit.  Pure: entries as data."""

from __future__ import annotations

from refit_worker.contract.entries import (
    BarrierEntry,
    ProgressEntry,
    ProgressState,
    RolloutMember,
)
from refit_worker.policy.owed import (
    Owed,
    RankMapping,
    all_have,
    lacks,
    not_serving,
    owed,
)
from refit_worker.session.rollout_reports import all_done

ONE = RankMapping(policy_rank=0, train_world_size=1, stripe=True, sharded=False)


def _barrier(*slots: tuple[str, int] | None, version: int = 1) -> BarrierEntry:
    return BarrierEntry(
        epoch=2,
        version=version,
        policy_uids=("p0", "p1"),
        rollout=tuple(
            None if s is None else RolloutMember(uid=s[0], generation=s[1]) for s in slots
        ),
    )


def _progress(rank: int, uid: str, completed: int, state: ProgressState) -> ProgressEntry:
    return ProgressEntry(
        epoch=1, uid=uid, role="rollout", rank=rank, state=state, refits_completed=completed
    )


def test_a_lingering_policy_owes_the_last_refit_to_members_without_it() -> None:
    barrier = _barrier(("a", 0), ("b", 1), ("c", 0))
    progress = {
        ("rollout", 0): _progress(0, "a", 4, "done"),
        # Rank 1's report is its replaced pod's: the new pod has not reported yet.
        ("rollout", 1): _progress(1, "b-old", 4, "done"),
        ("rollout", 2): _progress(2, "c", 2, "running"),
    }
    due = owed(barrier, progress, refit=3, confirmed=set(), mapping=ONE)
    assert due == {1: Owed(1, "b", 3, 1), 2: Owed(2, "c", 3, 1)}
    assert not all_done(barrier, progress)
    progress[("rollout", 1)] = _progress(1, "b", 4, "done")
    progress[("rollout", 2)] = _progress(2, "c", 4, "done")
    assert owed(barrier, progress, refit=3, confirmed=set(), mapping=ONE) == {}
    assert all_done(barrier, progress)


def test_a_first_round_owes_every_member_and_a_confirmation_settles_one() -> None:
    barrier = _barrier(("a", 0), None, ("c", 0), version=7)
    # Progress not read (a refit's first round): every listed member lacks it.
    assert owed(barrier, None, refit=5, confirmed=set(), mapping=ONE) == {
        0: Owed(0, "a", 5, 7),
        2: Owed(2, "c", 5, 7),
    }
    # Confirmed by the pod now in the slot: not owed; by the pod it replaced: still owed.
    assert set(owed(barrier, None, refit=5, confirmed={(0, "a")}, mapping=ONE)) == {2}
    assert set(owed(barrier, None, refit=5, confirmed={(2, "c-old")}, mapping=ONE)) == {0, 2}


def test_two_policy_ranks_each_owe_their_own_members_unless_sharded() -> None:
    barrier = _barrier(("a", 0), ("b", 0), ("c", 0), ("d", 0))
    by_rank = {
        p: set(
            owed(
                barrier,
                None,
                refit=0,
                confirmed=set(),
                mapping=RankMapping(p, 2, stripe=False, sharded=False),
            )
        )
        for p in (0, 1)
    }
    # Unstriped, 2 policy ranks over 4 rollout ranks: each member has one source, and
    # between them the two ranks owe every member exactly once.
    assert by_rank[0] | by_rank[1] == {0, 1, 2, 3}
    assert by_rank[0] & by_rank[1] == set()
    assert by_rank[0] and by_rank[1]
    # A sharded refit: every member holds blocks of each rank's shards.
    for p in (0, 1):
        sharded = RankMapping(p, 2, stripe=False, sharded=True)
        assert set(owed(barrier, None, refit=0, confirmed=set(), mapping=sharded)) == {0, 1, 2, 3}


def test_only_a_running_rank_that_has_not_committed_lacks_a_refit() -> None:
    progress = {
        ("rollout", 0): _progress(0, "a", 3, "running"),
        ("rollout", 1): _progress(1, "b", 2, "failed"),
    }
    assert lacks(progress, 0, "a", 3)  # committed 0..2: refit 3 is still to come
    assert not lacks(progress, 0, "a", 2)
    assert not lacks(progress, 1, "b", 5)  # a failed rank is owed nothing
    assert lacks(progress, 1, "b-new", 5)  # its replacement has not reported yet
    assert lacks(None, 0, "a", 0)


def test_an_empty_slot_is_done_only_when_its_last_pod_said_so() -> None:
    barrier = _barrier(("a", 0), None)
    progress = {("rollout", 0): _progress(0, "a", 4, "done")}
    assert owed(barrier, progress, refit=3, confirmed=set(), mapping=ONE) == {}
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
    progress = {
        ("rollout", 0): _progress(0, "a", 5, "running"),
        ("rollout", 1): _progress(1, "b-old", 9, "done"),  # the replaced pod's report
    }
    assert all_have({0: Owed(0, "a", 4, 1)}, progress)
    assert not all_have({0: Owed(0, "a", 5, 1)}, progress)
    assert not all_have({0: Owed(0, "a", 4, 1), 1: Owed(1, "b", 4, 1)}, progress)
    assert not all_have({}, progress)


def test_a_lockstep_trainer_waits_for_every_slot_including_one_being_replaced() -> None:
    barrier = _barrier(("a", 0), ("b", 1), None)
    progress = {
        ("rollout", 0): _progress(0, "a", 6, "running"),
        # Slot 1's report is its replaced pod's, which had committed refit 5.
        ("rollout", 1): _progress(1, "b-old", 6, "running"),
        ("rollout", 2): _progress(2, "c-old", 6, "running"),
    }
    # Slot 1's new pod has not reported; slot 2 is empty (its replacement on its way).
    assert not_serving(barrier, progress, 5) == [1, 2]
    progress[("rollout", 1)] = _progress(1, "b", 6, "running")
    assert not_serving(barrier, progress, 5) == [2]
    full = _barrier(("a", 0), ("b", 1), ("c", 0))
    progress[("rollout", 2)] = _progress(2, "c", 5, "running")  # one refit behind
    assert not_serving(full, progress, 5) == [2]
    progress[("rollout", 2)] = _progress(2, "c", 7, "running")  # a later one serves too
    assert not_serving(full, progress, 5) == []
