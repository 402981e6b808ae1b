"""One failure domain, for the policy gang and for each rollout slot (pure): what a
failure, a preemption and a restart that is neither do to its incarnation, its counts and
its next retry; the backoff it waits by; and the status fields it is a view over, read
and written back unchanged (the status schema stays as it is).

Real: the failure domain, the status models.  Nothing is emulated.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from refit_operator.api.models import RefitJobStatus, RolloutReplica
from refit_operator.core import failure_domain as fd
from refit_operator.core.failure_domain import FailureDomain

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
LATER = NOW + timedelta(seconds=90)


def _domain(failures: int = 0, preemptions: int = 0) -> FailureDomain:
    return FailureDomain(incarnation=4, failures=failures, preemptions=preemptions, next_retry=None)


@pytest.mark.parametrize(
    ("stop", "failures", "preemptions"),
    [("failed", 3, 1), ("preempted", 2, 2), ("restarted", 2, 1)],
)
def test_each_stop_moves_to_the_next_incarnation(
    stop: str, failures: int, preemptions: int
) -> None:
    after = getattr(_domain(2, 1), stop)(NOW, 12.5)
    assert after == FailureDomain(
        incarnation=5,
        failures=failures,
        preemptions=preemptions,
        next_retry=NOW + timedelta(seconds=12.5),
    )


@pytest.mark.parametrize(
    ("failures", "wait"), [(0, 10.0), (1, 20.0), (2, 40.0), (5, 300.0), (50, 300.0)]
)
def test_backoff_doubles_per_failure_counted_before(failures: int, wait: float) -> None:
    assert _domain(failures).backoff(10.0, 300.0) == wait


@pytest.mark.parametrize(
    ("retry", "wait"),
    [(None, None), (NOW - timedelta(seconds=1), None), (NOW, None), (LATER, 90.0)],
)
def test_waits_until_its_next_retry(retry: datetime | None, wait: float | None) -> None:
    domain = FailureDomain(incarnation=0, failures=0, preemptions=0, next_retry=retry)
    assert domain.waits(NOW) == wait


def test_the_policy_gang_is_a_view_over_its_status_fields() -> None:
    status = RefitJobStatus(epoch=3, restarts=2, preemptions=5, restart_at=LATER)
    gang = fd.policy_gang(status)
    assert gang == FailureDomain(incarnation=3, failures=2, preemptions=5, next_retry=LATER)
    assert status.model_copy(update=fd.policy_gang_fields(gang)) == status
    failed = status.model_copy(update=fd.policy_gang_fields(gang.failed(NOW, 40.0)))
    assert (failed.epoch, failed.restarts, failed.preemptions) == (4, 3, 5)
    assert failed.restart_at == NOW + timedelta(seconds=40)


def test_a_rollout_slot_is_a_view_over_its_replica_entry() -> None:
    replica = RolloutReplica(rank=1, generation=7, pod="p", failures=2, replace_at=LATER)
    slot = fd.rollout_slot(replica)
    assert slot == FailureDomain(incarnation=7, failures=2, preemptions=0, next_retry=LATER)
    assert replica.model_copy(update=fd.rollout_slot_fields(slot)) == replica
    # A slot records no preemptions of its own: they show in rollout.replacements.
    preempted = replica.model_copy(update=fd.rollout_slot_fields(slot.preempted(NOW, 0.0)))
    assert (preempted.generation, preempted.failures, preempted.replace_at) == (8, 2, NOW)
    assert "preemptions" not in fd.rollout_slot_fields(slot)
