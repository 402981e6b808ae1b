"""The stages of a round's decision (pure): their order, that accounting runs whatever is
decided after it, that a stage which ends the round ends it (no later stage runs), and
that the outcome maps to a phase.

Real: the reconcile with its stages replaced by recorders (``monkeypatch``) and, for the
phase, the phase table.  Nothing is emulated.
"""

from __future__ import annotations

from typing import Any

import pytest

from refit_operator.api.models import Phase
from refit_operator.core import reconcile as rec
from refit_operator.core import stages
from refit_operator.core.phases import Outcome, phase_of


def _recorders(monkeypatch: pytest.MonkeyPatch, ends: dict[str, Outcome]) -> list[str]:
    called: list[str] = []
    for name in stages.STAGES:

        def stage(inp: Any, draft: Any, name: str = name) -> Outcome | None:
            called.append(name)
            return ends.get(name)

        monkeypatch.setattr(stages, name, stage)
    return called


def test_the_stages_run_in_order() -> None:
    assert stages.STAGES == ("account", "settle", "record", "police", "advance")


@pytest.mark.parametrize(
    ("ends", "ran", "outcome"),
    [
        ({"advance": Outcome.ALL_READY}, list(stages.STAGES), Outcome.ALL_READY),
        ({"settle": Outcome.SETTLED}, ["account", "settle"], Outcome.SETTLED),
        (
            {"police": Outcome.GANG_DISRUPTED, "advance": Outcome.NOT_READY},
            ["account", "settle", "record", "police"],
            Outcome.GANG_DISRUPTED,
        ),
    ],
)
def test_a_stage_that_ends_the_round_ends_it(
    monkeypatch: pytest.MonkeyPatch, ends: dict[str, Outcome], ran: list[str], outcome: Outcome
) -> None:
    called = _recorders(monkeypatch, ends)
    assert rec.decide(None, None) is outcome  # type: ignore[arg-type]
    assert called == ran


@pytest.mark.parametrize(
    ("outcome", "current", "phase"),
    [
        (Outcome.SETTLED, Phase.SUCCEEDED, Phase.SUCCEEDED),
        (Outcome.SUSPENDED, Phase.RUNNING, Phase.SUSPENDED),
        (Outcome.DEADLINE_EXCEEDED, Phase.RUNNING, Phase.FAILED),
        (Outcome.RESTARTS_EXHAUSTED, Phase.RESTARTING, Phase.FAILED),
        (Outcome.NOT_RETRYABLE, Phase.PENDING, Phase.FAILED),
        (Outcome.ALL_ROLLOUTS_DONE, Phase.RUNNING, Phase.SUCCEEDED),
        (Outcome.GANG_DISRUPTED, Phase.RUNNING, Phase.RESTARTING),
        (Outcome.WAITING_FOR_GANG, Phase.RESTARTING, Phase.RESTARTING),
        (Outcome.ALL_READY, Phase.PENDING, Phase.RUNNING),
        (Outcome.NOT_READY, Phase.RUNNING, Phase.PENDING),
    ],
)
def test_each_outcome_maps_to_a_phase(outcome: Outcome, current: Phase, phase: Phase) -> None:
    assert phase_of(outcome, current=current) is phase
