"""A rank's ``ProgressLog``: ``refits_completed`` is the last committed refit id + 1, so a
rollout rank that joined late (and skipped refits it missed) counts from the job's start
like the others.  Pure."""

from __future__ import annotations

import pytest

from refit_worker.contract.progress import ProgressLog


def test_refits_in_order_count_one_each() -> None:
    log = ProgressLog(2)
    for refit in (2, 3, 4):
        log.record(refit, 100, 0.1)
    assert (log.refits_completed, log.bytes_total) == (5, 300)
    assert [r.refit for r in log.recent] == [2, 3, 4]


def test_a_joiner_that_skipped_refits_counts_from_the_job_start() -> None:
    log = ProgressLog(0)  # a replacement that starts at first_refit 0 ...
    log.record(7, 100, 0.1)  # ... and takes refit 7, the next one the policy sends
    assert log.refits_completed == 8
    log.record(8, 100, 0.1)
    assert (log.refits_completed, log.bytes_total) == (9, 200)


def test_an_older_refit_never_moves_the_count_back() -> None:
    log = ProgressLog(0)
    log.record(5, 10, 0.1)
    log.record(3, 10, 0.1)
    assert log.refits_completed == 6


def test_bad_figures_are_refused() -> None:
    with pytest.raises(ValueError, match="refit id and its bytes"):
        ProgressLog().record(-1, 10, 0.1)
