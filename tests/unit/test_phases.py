"""The phase machine, table-tested (pure)."""

from __future__ import annotations

import pytest

from refit_operator.api.models import Phase
from refit_operator.core.phases import TRANSITIONS, PhaseFacts, is_legal, next_phase

P = Phase


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        (PhaseFacts(current=P.PENDING), P.PENDING),
        (PhaseFacts(current=P.PENDING, all_ready=True), P.RUNNING),
        (PhaseFacts(current=P.RUNNING), P.PENDING),  # a pod stopped being ready
        (PhaseFacts(current=P.RUNNING, gang_disrupted=True, all_ready=True), P.RESTARTING),
        (PhaseFacts(current=P.RESTARTING, waiting_for_gang=True), P.RESTARTING),
        (PhaseFacts(current=P.RESTARTING), P.PENDING),  # the new gang was created
        (PhaseFacts(current=P.RUNNING, restarts_exhausted=True, gang_disrupted=True), P.FAILED),
        (PhaseFacts(current=P.RUNNING, invalid=True), P.FAILED),
        (PhaseFacts(current=P.RUNNING, deadline_exceeded=True, all_ready=True), P.FAILED),
        (PhaseFacts(current=P.PENDING, deadline_exceeded=True), P.FAILED),
        (PhaseFacts(current=P.RUNNING, suspended=True), P.SUSPENDED),
        (PhaseFacts(current=P.SUSPENDED), P.PENDING),  # resumed
        (PhaseFacts(current=P.RUNNING, all_rollouts_done=True), P.SUCCEEDED),
        (PhaseFacts(current=P.PENDING, all_rollouts_done=True), P.SUCCEEDED),
        (PhaseFacts(current=P.SUCCEEDED, suspended=True, invalid=True), P.SUCCEEDED),
        (PhaseFacts(current=P.FAILED, all_ready=True), P.FAILED),
        (PhaseFacts(current=P.FAILED, retry_invalid=True), P.PENDING),
        (PhaseFacts(current=P.FAILED, retry_invalid=True, all_ready=True), P.RUNNING),
        (PhaseFacts(current=P.FAILED, retry_invalid=True, suspended=True), P.SUSPENDED),
        (PhaseFacts(current=P.FAILED, retry_invalid=True, gang_disrupted=True), P.RESTARTING),
        (PhaseFacts(current=P.FAILED, retry_invalid=True, invalid=True), P.FAILED),
        (PhaseFacts(current=P.FAILED, invalid=True), P.FAILED),
        (PhaseFacts(current=P.PENDING, invalid=True), P.FAILED),
        (PhaseFacts(current=P.SUSPENDED, invalid=True), P.FAILED),
        (PhaseFacts(current=P.SUCCEEDED, invalid=True), P.SUCCEEDED),
        (PhaseFacts(current=P.RUNNING, suspended=True, invalid=True), P.FAILED),
        (PhaseFacts(current=P.RUNNING, suspended=True, all_rollouts_done=True), P.SUSPENDED),
    ],
)
def test_next_phase(facts: PhaseFacts, expected: Phase) -> None:
    assert next_phase(facts) is expected


def test_every_rule_result_is_a_legal_move() -> None:
    flags = [
        "invalid",
        "restarts_exhausted",
        "deadline_exceeded",
        "suspended",
        "all_rollouts_done",
        "gang_disrupted",
        "waiting_for_gang",
        "all_ready",
        "retry_invalid",
    ]
    for current in Phase:
        for mask in range(1 << len(flags)):
            facts = PhaseFacts(
                current=current, **{f: bool(mask >> i & 1) for i, f in enumerate(flags)}
            )
            new = next_phase(facts)
            assert is_legal(current, new), (current, new, facts)


def test_succeeded_is_final_and_table_covers_every_phase() -> None:
    assert set(TRANSITIONS) == set(Phase)
    assert TRANSITIONS[P.SUCCEEDED] == frozenset()
    assert not is_legal(P.SUCCEEDED, P.PENDING)
    assert not is_legal(P.RESTARTING, P.RUNNING)  # must pass through Pending
