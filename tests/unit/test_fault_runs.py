"""Where a drained rank stopped, read from its log (``tests.support.fault_runs``): pure.

The log lines are those real ranks wrote in a drain-stage run on a loaded machine.
"""

from __future__ import annotations

import pytest
from tests.support.fault_runs import (
    FULL_MATRIX_ENV,
    StopPoint,
    preempted_reason,
    sampled,
    stop_point,
)

_ABANDONED = (
    "05 refit_worker.rollout.rollout_session WARNING rollout rank 0: refit in flight abandoned "
    "(the membership moved on (a new policy epoch, or not listed now)); joining again\n"
    "06 refit_worker WARNING rollout rank 0 (epoch 0): preempted: rollout rank 0: stop "
    "requested while waiting for the barrier of epoch 0\n"
)
_WAITING = (
    "04 refit_worker WARNING rollout rank 0 (epoch 0): preempted: rollout rank 0: stop "
    "requested while waiting for the barrier of epoch 0\n"
)
_BUCKET = (
    "05 refit_worker WARNING rollout rank 0 (epoch 0): preempted: rollout rank 0: stopped "
    "at a bucket boundary for a preemption\n"
)
_BOUNDARY = (
    "05 refit_worker WARNING rollout rank 0 (epoch 0): preempted: signal received by "
    "rollout rank(s) [0]\n"
)
# A refit abandoned for a new policy epoch, then taken and committed; stopped later at a
# refit boundary: the abandon is not what the stop met.
_ABANDONED_THEN_BOUNDARY = _ABANDONED.split("\n", 1)[0] + "\n" + _BOUNDARY


@pytest.mark.parametrize(
    ("log", "where"),
    [
        (_ABANDONED, StopPoint.ABANDONED),
        (_WAITING, StopPoint.CONNECT),
        (_BUCKET, StopPoint.BUCKET),
        (_BOUNDARY, StopPoint.BOUNDARY),
        (_ABANDONED_THEN_BOUNDARY, StopPoint.BOUNDARY),
    ],
    ids=["abandoned-then-stopped", "waiting", "bucket", "boundary", "abandoned-then-boundary"],
)
def test_where_a_rank_stopped_follows_its_log(log: str, where: StopPoint) -> None:
    why = preempted_reason(log)
    assert why is not None
    assert stop_point(why, "preempted") is where


def test_a_log_that_never_says_preempted_has_no_reason() -> None:
    assert preempted_reason("01 rollout rank 0: refit 3 committed\n") is None


def test_ci_runs_its_sample_and_the_full_matrix_on_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(FULL_MATRIX_ENV, raising=False)
    assert sampled([1, 2, 3], [2]) == [2]
    monkeypatch.setenv(FULL_MATRIX_ENV, "1")
    assert sampled([1, 2, 3], [2]) == [1, 2, 3]


def test_a_sample_outside_the_matrix_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\[4\]"):
        sampled([1, 2, 3], [2, 4])
