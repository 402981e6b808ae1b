"""The signal-gang example's pure parts (``examples/signal_gang.py``): argument checks and
the verdict on how the ranks stopped.

Pure: reports are built as data here; the real run is in ``tests/e2e/test_signal_gang.py``.
"""

from __future__ import annotations

import signal

import pytest

import signal_gang as demo
from refit_worker.contract.exits import EXIT_PREEMPTED
from signal_gang import DemoResult, DemoSettings, RankReport

SETTINGS = DemoSettings(ranks=3, steps=10, signal_rank=1, signal_at=4)


def _good(rank: int) -> RankReport:
    return RankReport(rank, 1000 + rank, 4, [False, True, False], 4, EXIT_PREEMPTED)


def test_ranks_that_stopped_together_have_no_problems() -> None:
    assert DemoResult(SETTINGS, tuple(_good(r) for r in range(3))).problems() == []


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"stopped_at": 5}, "rank 2 stopped at step 5, not 4"),
        ({"stopped_at": None}, "rank 2 stopped at step None, not 4"),
        ({"seen": [True, True, False]}, "rank 2 saw [True, True, False], expected"),
        ({"seen": [False, False, False]}, "rank 2 saw [False, False, False]"),
        ({"polls_before": 3}, "rank 2 made 3 clean polls, not 4"),
        ({"exit_code": 1}, f"rank 2 exited 1, not {EXIT_PREEMPTED}"),
        ({"exit_code": None}, f"rank 2 exited None, not {EXIT_PREEMPTED}"),
    ],
)
def test_each_disagreement_is_named(change: dict[str, object], problem: str) -> None:
    odd = _good(2)
    for name, value in change.items():
        setattr(odd, name, value)
    problems = DemoResult(SETTINGS, (_good(0), _good(1), odd)).problems()
    assert len(problems) == 1
    assert problems[0].startswith(problem)


def test_defaults_and_signal_names() -> None:
    settings = demo.settings_from_args(demo._parser().parse_args(["--signal", "usr1"]))
    assert settings == DemoSettings(sig=signal.SIGUSR1)
    assert settings.ranks == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "0"], "--ranks must be at least 1, got 0"),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--signal-rank", "3"], "--signal-rank must be in [0, 3), got 3"),
        (["--ranks", "2", "--signal-rank", "-1"], "--signal-rank must be in [0, 2), got -1"),
        (["--signal-at", "30"], "--signal-at must be in [0, 30), got 30"),
        (["--step-seconds", "-0.5"], "--step-seconds must be >= 0, got -0.5"),
        (["--timeout", "0"], "--timeout must be > 0, got 0.0"),
        (["--timeout", "nan"], "--timeout must be > 0, got nan"),
        (["--signal", "SIGNOPE"], "Unknown signal name 'SIGNOPE'"),
    ],
)
def test_bad_arguments_exit_2_naming_the_value(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        demo.main(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        demo.main(["--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    assert "DistributedSignalHandler" in out
    assert "--signal-rank" in out
    assert "--worker-rank" not in out  # internal
