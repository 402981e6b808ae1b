"""The operator's one backoff (pure), table-tested: the doubling from the first delay,
the cap, the first try, a zero delay, and a count past the float range; and the three
places that wait by it (the policy gang's restarts, a rollout rank's replacements, the
controller's retries) agree with the formula they were written with.

Real: the backoff.  Nothing is emulated.
"""

from __future__ import annotations

import pytest

from refit_operator.core.backoff import doubling
from refit_operator.shell.controller import RETRY_MAX_S, RETRY_MIN_S


@pytest.mark.parametrize(
    ("first", "cap", "attempt", "wait"),
    [
        (10.0, 300.0, 1, 10.0),
        (10.0, 300.0, 2, 20.0),
        (10.0, 300.0, 3, 40.0),
        (10.0, 300.0, 5, 160.0),
        (10.0, 300.0, 6, 300.0),  # 320 capped
        (10.0, 300.0, 60, 300.0),
        (10.0, 300.0, 0, 10.0),  # no failure counted yet: the first delay
        (10.0, 300.0, -3, 10.0),
        (10.0, 5.0, 1, 5.0),  # a cap under the first delay wins at once
        (0.0, 300.0, 7, 0.0),  # no backoff asked: none, however many failures
        (0.0, 0.0, 1, 0.0),
        (1.0, 30.0, 5, 16.0),
        (0.5, 30.0, 2000, 30.0),  # past the float range: the cap, not an OverflowError
        (1.0, 1e308, 5000, 1e308),
    ],
)
def test_doubling(first: float, cap: float, attempt: int, wait: float) -> None:
    got = doubling(first, cap, attempt)
    assert got == wait
    assert isinstance(got, float)


@pytest.mark.parametrize("attempt", range(0, 12))
def test_same_as_the_formulas_it_replaces(attempt: int) -> None:
    """The copies it replaced: ``min(cap, first * 2 ** max(0, n - 1))`` for the policy
    gang and the rollout slots, ``min(RETRY_MAX_S, RETRY_MIN_S * 2 ** n)`` in the
    controller (n >= 1 there)."""
    assert doubling(3.0, 700.0, attempt) == float(min(700.0, 3.0 * 2 ** max(0, attempt - 1)))
    if attempt >= 1:
        old = min(RETRY_MAX_S, RETRY_MIN_S * 2**attempt)
        assert doubling(RETRY_MIN_S * 2, RETRY_MAX_S, attempt) == old
