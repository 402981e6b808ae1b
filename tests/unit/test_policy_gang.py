"""The policy gang's one plan per refit (``refit_worker.policy.gang_plan``): the plan's wire
form and the verdict every rank folds from the gathered flags.  Pure: no process group (the
collectives themselves run in tests/e2e/test_worker_failure_domains.py)."""

from __future__ import annotations

import pytest

from refit_worker.contract.entries import BarrierEntry, RolloutMember
from refit_worker.contract.failures import RefusedConfigError
from refit_worker.policy.gang_plan import (
    GangPlanError,
    PolicyGang,
    RefitPlan,
    Verdict,
    decode_plan,
    encode_plan,
    fold_verdict,
)

BARRIER = BarrierEntry(
    epoch=3,
    version=7,
    policy_uids=("p0", "p1"),
    rollout=(RolloutMember(uid="r0"), None, RolloutMember(uid="r2", generation=1)),
    generations=(0, 1, 1),
)


def test_a_plan_crosses_the_group_as_json_and_comes_back_equal() -> None:
    data = encode_plan(RefitPlan(refit_id=12, barrier=BARRIER))
    assert data.startswith(b"{")  # JSON, never a pickle
    plan = decode_plan(data, 12)
    assert plan.barrier == BARRIER and plan.barrier.rollout_world_size == 3


def test_a_plan_for_another_refit_or_not_a_plan_is_refused() -> None:
    data = encode_plan(RefitPlan(refit_id=12, barrier=BARRIER))
    with pytest.raises(GangPlanError, match="planned refit 12 while this rank sends refit 13"):
        decode_plan(data, 13)
    for garbage in (b"\x80\x04K\x01.", b'{"v": 2, "refit_id": 1}', b"{}"):
        with pytest.raises(GangPlanError, match="cannot read"):
            decode_plan(garbage, 1)


@pytest.mark.parametrize(
    ("flags", "verdict"),
    [
        ([1, 1], Verdict(settled=True, past=False)),
        ([1, 0], Verdict(settled=True, past=False)),  # one rank's member got it: done
        ([0, 0], Verdict(settled=False, past=False)),  # nobody's: every rank sends again
        ([0, 2], Verdict(settled=False, past=True)),  # one rank's deadline: all give up
        ([3, 2], Verdict(settled=True, past=True)),  # settled wins (the caller checks it first)
        ([0], Verdict(settled=False, past=False)),
    ],
)
def test_every_rank_folds_the_same_verdict(flags: list[int], verdict: Verdict) -> None:
    assert fold_verdict(flags) == verdict


def test_a_gang_of_one_plans_and_judges_alone() -> None:
    gang = PolicyGang(None, world_size=1)
    assert gang.plan(4, lambda: BARRIER) is BARRIER
    assert gang.verdict(settled=False, past=True) == Verdict(settled=False, past=True)


def test_several_policy_ranks_without_a_group_are_refused_at_connect() -> None:
    with pytest.raises(RefusedConfigError, match=r"2 policy ranks need their torch\.distributed"):
        PolicyGang(None, world_size=2)
