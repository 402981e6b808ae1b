"""What a policy rank owes each rollout member, decided from the membership and the ranks'
progress reports: pure functions, no I/O.

The one serve loop of :class:`~refit_worker.policy.policy_session.PolicySession` (a refit's
send, its re-send by a new plan, the linger after the last refit) asks :func:`owed` each round
and sends to what it names; these functions are the whole of what it decides from.

- :func:`owed`: the members of a barrier that lack a refit, did not confirm it to this
  rank, and that this rank sends to by the rank mapping, each with the refit and the
  membership version it is owed by;
- :func:`all_have`: whether those members' pods reported the refit committed (then a send
  that reached no one still settled it);
- :func:`not_serving`: the rollout slots whose pod has not committed a refit yet (a
  lockstep trainer waits for none before its next step).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from refit_worker.contract.entries import BarrierEntry
from refit_worker.engine import targets_for_policy
from refit_worker.session.following import members
from refit_worker.session.rollout_reports import Progress, report_for


@dataclass(frozen=True, slots=True)
class Owed:
    """One rollout member's due from this policy rank: ``refit``, by the barrier of
    ``version``, to the pod ``uid`` that holds rollout rank ``rank`` now."""

    rank: int
    uid: str
    refit: int
    version: int


@dataclass(frozen=True, slots=True)
class RankMapping:
    """How this policy rank maps to rollout ranks (the engine's settings)."""

    policy_rank: int
    train_world_size: int
    stripe: bool
    sharded: bool


def lacks(progress: Progress | None, rank: int, uid: str, refit: int) -> bool:
    """Whether pod ``uid`` in rollout slot ``rank`` still needs ``refit``: no report of its
    own, or a running rank that has not committed it.  ``progress=None`` (not read, e.g. a
    refit's first round) counts every member as lacking it."""
    if progress is None:
        return True
    report = report_for(progress, rank, uid)
    return report is None or (report.refits_completed <= refit and report.state == "running")


def owed(
    barrier: BarrierEntry,
    progress: Progress | None,
    *,
    refit: int,
    confirmed: frozenset[tuple[int, str]] | set[tuple[int, str]],
    mapping: RankMapping,
) -> dict[int, Owed]:
    """What this policy rank owes for ``refit`` under ``barrier``: rank -> :class:`Owed`.

    A member is owed it when it lacks it (:func:`lacks`), did not confirm it to this rank
    (``confirmed``: (rank, pod uid) pairs), and this rank is one of its sources (every
    rank is, for a sharded refit); another policy rank owes it the rest."""
    listed = members(barrier)
    lacking = {
        rank
        for rank, (uid, _generation) in listed.items()
        if (rank, uid) not in confirmed and lacks(progress, rank, uid, refit)
    }
    mine = targets_for_policy(
        mapping.policy_rank,
        train_world_size=mapping.train_world_size,
        rollout_world_size=barrier.rollout_world_size,
        members=lacking,
        stripe=mapping.stripe,
        sharded=mapping.sharded,
    )
    return {rank: Owed(rank, listed[rank][0], refit, barrier.version) for rank in mine}


def all_have(due: Mapping[int, Owed], progress: Progress) -> bool:
    """Whether the pod of each due member reported its refit committed; False for none."""
    return bool(due) and all(
        (report := report_for(progress, rank, o.uid)) is not None
        and report.refits_completed > o.refit
        for rank, o in due.items()
    )


def not_serving(barrier: BarrierEntry, progress: Progress, refit: int) -> list[int]:
    """The rollout slots of ``barrier`` that do not serve ``refit`` (or a later one) yet:
    empty (a replacement on its way), or held by a pod whose own report has not committed
    it.  Empty when every slot serves it."""
    slots = members(barrier)
    return [
        rank
        for rank in range(len(barrier.rollout))
        if rank not in slots
        or (report := report_for(progress, rank, slots[rank][0])) is None
        or report.refits_completed <= refit
    ]


def seeding_peer(barrier: BarrierEntry, progress: Progress, last: int) -> int | None:
    """A rollout member whose pod committed refit ``last`` and stays to seed late peers
    with it (its report says ``seeding``), by rank; None if there is none.  While one
    stays, a late member is seeded by it, so a policy rank need not linger."""
    for rank, (uid, _generation) in sorted(members(barrier).items()):
        report = report_for(progress, rank, uid)
        if report is not None and report.seeding and report.refits_completed > last:
            return rank
    return None


__all__ = [
    "Owed",
    "Progress",
    "RankMapping",
    "all_have",
    "lacks",
    "owed",
    "seeding_peer",
]
