"""The pid registry and the preStop delivery command: pure parts and argument checks.

Pure: the delivery plan is decided from registrations and a table of what ``/proc`` says,
given as data.  The argument tests run ``main`` in this process and send no signal (every
case stops at argument checking or finds nothing registered).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from refit_worker.contract.env import PREEMPTION_SIGNAL_ENV, SIGNAL_PID_DIR_ENV
from refit_worker.signals import delivery as sd
from refit_worker.signals import pid_registry as registry
from refit_worker.signals.delivery import plan_delivery
from refit_worker.signals.pid_registry import ProcState, Registration

TERM, USR1, USR2 = signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2


def reg(pid: int, start: int | None, *signals: signal.Signals) -> Registration:
    return Registration(Path(f"/pids/{pid}-x.json"), pid, start, tuple(signals))


PROCS = {
    100: ProcState("S", 5000),
    101: ProcState("R", 6000),
    102: ProcState("Z", 7000),  # exited, not yet reaped
    103: ProcState("S", 9999),  # pid reused by a later process
    104: ProcState("S", None),  # no start time known here
}


@pytest.mark.parametrize(
    ("registrations", "send", "stale_pids"),
    [
        ([], [], []),
        ([reg(100, 5000, TERM)], [(100, TERM)], []),
        ([reg(100, 5000, USR1, TERM)], [(100, USR1)], []),  # first signal only
        ([reg(100, 5000)], [(100, USR2)], []),  # names none: the fallback
        ([reg(100, None, TERM)], [(100, TERM)], []),  # no start time recorded
        ([reg(104, 1234, TERM)], [(104, TERM)], []),  # none readable now
        ([reg(200, 5000, TERM)], [], [200]),  # gone
        ([reg(102, 7000, TERM)], [], [102]),  # zombie
        ([reg(103, 8000, TERM)], [], [103]),  # pid reuse
        ([reg(100, 5000, TERM), reg(100, 5000, TERM)], [(100, TERM)], []),  # nested: once
        ([reg(100, 5000, TERM), reg(100, 5000, USR1)], [(100, TERM), (100, USR1)], []),
        (
            [reg(100, 5000, TERM), reg(200, 1, TERM), reg(101, 6000, USR1), reg(103, 1, TERM)],
            [(100, TERM), (101, USR1)],
            [200, 103],
        ),
    ],
)
def test_plan(
    registrations: list[Registration],
    send: list[tuple[int, signal.Signals]],
    stale_pids: list[int],
) -> None:
    plan = plan_delivery(registrations, USR2, PROCS.get)
    assert list(plan.send) == send
    assert [r.pid for r in plan.stale] == stale_pids


def test_parse_registration_round_trip(tmp_path: Path) -> None:
    path = registry.register(tmp_path, [USR1, TERM])
    parsed = registry.parse_registration(path, path.read_text())
    own = registry.read_proc_state(os.getpid())
    assert own is not None
    assert parsed == Registration(path, os.getpid(), own.start_time, (USR1, TERM))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"signals": ["SIGTERM"]}', "pid must be a positive integer, got None"),
        ('{"pid": "12"}', "pid must be a positive integer, got '12'"),
        ('{"pid": true}', "pid must be a positive integer, got True"),
        ('{"pid": 0}', "pid must be a positive integer, got 0"),  # would hit a process group
        ('{"pid": -5}', "pid must be a positive integer, got -5"),
        ('{"pid": 1.5}', "pid must be a positive integer, got 1.5"),
        ('{"pid": 12, "start_time": "x"}', "start_time must be an integer or null, got 'x'"),
        ('{"pid": 12, "signals": "SIGTERM"}', "signals must be a list of names"),
        ('{"pid": 12, "signals": ["SIGNOPE"]}', "Unknown signal name 'SIGNOPE'"),
    ],
)
def test_parse_registration_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"bad\.json") as caught:
        registry.parse_registration(Path("bad.json"), text)
    assert message in str(caught.value)


def test_minimal_registration_from_another_writer() -> None:
    parsed = registry.parse_registration(Path("7.json"), '{"pid": 7}')
    assert parsed == Registration(Path("7.json"), 7, None, ())
    # A trainer that is its container's first process registers as pid 1.
    assert registry.parse_registration(Path("1.json"), '{"pid": 1}').pid == 1


def test_delivery_command_loads_only_the_standard_library() -> None:
    # It runs as a preStop exec in any container: no torch, no pydantic, no WorkerConfig.
    # Checked in a fresh interpreter, so what the command's imports import counts too.
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import refit_worker.signals.delivery\n"
        "print(' '.join(sorted(m for m in set(sys.modules) - before"
        " if m.split('.')[0] not in sys.stdlib_module_names)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    )
    loaded = set(done.stdout.split())
    assert loaded == {
        "refit_worker",
        "refit_worker.contract",
        "refit_worker.contract.env",
        "refit_worker.contract.signals",
        "refit_worker.signals",
        "refit_worker.signals.pid_registry",
        "refit_worker.signals.delivery",
        "refit_worker.contract.waits",
    }


def test_read_registrations_reports_bad_files(tmp_path: Path) -> None:
    (tmp_path / "42-a.json").write_text(json.dumps({"pid": 42, "signals": ["USR1"]}))
    (tmp_path / "43-b.json").write_text("garbage")
    (tmp_path / ".44-c.json.tmp").write_text("half written")
    (tmp_path / "notes.txt").write_text("not a registration")
    found, problems = registry.read_registrations(tmp_path)
    assert [(r.pid, r.signals) for r in found] == [(42, (USR1,))]
    assert len(problems) == 1
    assert "43-b.json" in problems[0]


def test_fifos_links_and_binary_files_are_named_not_waited_on(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "50-fifo.json")  # reading it would block until a writer came
    (tmp_path / "51-bin.json").write_bytes(b"\xff\xfe{}")
    (tmp_path / "52-big.json").write_text(" " * (registry.MAX_REGISTRATION_BYTES + 1))
    (tmp_path / "target.txt").write_text(json.dumps({"pid": 53}))
    (tmp_path / "53-link.json").symlink_to(tmp_path / "target.txt")
    found, problems = registry.read_registrations(tmp_path)  # returns: nothing blocked
    assert found == []
    text = "\n".join(problems)
    assert "50-fifo.json: not a regular file" in text
    assert "51-bin.json: not UTF-8 text (byte 0)" in text
    assert "52-big.json" in text and "over the 4096-byte limit" in text
    assert "53-link.json" in text
    assert len(problems) == 4


def test_proc_state_of_self_and_of_a_gone_process() -> None:
    own = registry.read_proc_state(os.getpid())
    assert own is not None
    assert own.state == "R"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    assert registry.read_proc_state(gone.pid) is None


def _run_main(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> tuple[int | str | None, str, str]:
    try:
        code: int | str | None = sd.main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_no_dir_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(SIGNAL_PID_DIR_ENV, raising=False)
    code, _, err = _run_main(["--timeout", "1"], capsys)
    assert code == 2
    assert f"pass --dir or set {SIGNAL_PID_DIR_ENV}" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--signal", "SIGNOPE"], "--signal: Unknown signal name 'SIGNOPE'"),
        (["--signal", "TERM,TERM"], "--signal: Duplicate signals: SIGTERM given more than once"),
        (["--timeout", "-1"], "--timeout must be a finite number of seconds >= 0, got -1.0"),
        (["--timeout", "nan"], "got nan"),
        (["--timeout", "soon"], "invalid float value: 'soon'"),
    ],
)
def test_bad_arguments(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run_main(["--dir", str(tmp_path), *extra], capsys)
    assert code == 2
    assert message in err


def test_missing_dir_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run_main(["--dir", str(tmp_path / "nope")], capsys)
    assert code == 2
    assert f"pid directory {str(tmp_path / 'nope')!r} does not exist" in err


def test_env_supplies_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(SIGNAL_PID_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(PREEMPTION_SIGNAL_ENV, "BOGUS")
    code, _, err = _run_main([], capsys)
    assert code == 2  # the env's signal was read, and refused by name
    assert "'BOGUS'" in err
    monkeypatch.setenv(PREEMPTION_SIGNAL_ENV, "usr1,SIGTERM")
    code, out, _ = _run_main(["--timeout", "0"], capsys)
    assert code == 0  # an empty directory: nobody to signal
    assert "0 process(es) signalled" in out


def test_help_names_the_contract(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run_main(["--help"], capsys)
    assert code == 0
    for needle in ("--dir DIR", "--signal NAME[,NAME]", "--timeout SECONDS", "preStop"):
        assert needle in out
    assert SIGNAL_PID_DIR_ENV in out
    assert PREEMPTION_SIGNAL_ENV in out
