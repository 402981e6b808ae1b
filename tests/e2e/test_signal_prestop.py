"""The preStop path end to end: processes register, ``refit-signal`` signals them.

Real: listener processes that enter ``DistributedSignalHandler`` with the pid directory
they read from ``REFIT_SIGNAL_PID_DIR`` (``Preemption.from_env``), the delivery command run
as a subprocess by the argv the operator renders (``["refit-signal", "--timeout", "N"]``,
env for the rest), ``os.kill``, ``/proc``.  ``refit-signal`` is the console script that
pyproject declares, written into a temporary ``bin/`` the way an installer writes it, so a
plain checkout runs it too.  Nothing is emulated."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from refit_worker.contract.exits import EXIT_PREEMPTED
from refit_worker.signals.pid_registry import read_proc_state

ROOT = Path(__file__).resolve().parents[2]

LISTENER = f"""
import sys, time
from refit_worker.contract.env import Preemption
from refit_worker.signals.handler import DistributedSignalHandler
obey, sig = sys.argv[1] == "obey", sys.argv[2]
with DistributedSignalHandler(sig, pid_dir=Preemption.from_env().pid_dir) as handler:
    print("ready", flush=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if obey and handler.signals_received()[0]:
            sys.exit({EXIT_PREEMPTED})
        time.sleep(0.02)
sys.exit(3)
"""


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A pod-like environment: the pid dir env, the signal env, refit-signal on PATH."""
    pids = tmp_path / "pids"
    pids.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["refit-signal"].split(":")
    script = bin_dir / "refit-signal"
    script.write_text(
        f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n"
    )
    script.chmod(0o755)
    env = dict(os.environ)
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join([str(ROOT / "worker"), env.get("PYTHONPATH", "")]),
        REFIT_SIGNAL_PID_DIR=str(pids),
        REFIT_PREEMPTION_SIGNAL="SIGTERM",
    )
    yield env


def _start(env: dict[str, str], obey: bool, sig: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", LISTENER, "obey" if obey else "ignore", sig]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)


def _wait_ready(proc: subprocess.Popen[str], timeout: float = 90) -> None:
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], timeout)
    assert readable, f"pid {proc.pid} did not enter the handler within {timeout}s"
    assert proc.stdout.readline().strip() == "ready"


def _gone_pid() -> int:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(timeout=30)
    return done.pid


def _deliver(
    argv: list[str], env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the delivery command as a preStop exec would: argv and env, nothing else."""
    started = time.monotonic()
    done = subprocess.run(argv, env=env, check=False, capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - started


def _stop_all(procs: Sequence[subprocess.Popen[Any]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_prestop_signals_each_registered_process_and_waits(pod: dict[str, str]) -> None:
    pids = Path(pod["REFIT_SIGNAL_PID_DIR"])
    term = _start(pod, obey=True, sig="SIGTERM")
    usr1 = _start(pod, obey=True, sig="usr1")  # registers SIGUSR1: must get SIGUSR1
    quiet = dict(pod)
    del quiet["REFIT_SIGNAL_PID_DIR"]
    usr2 = _start(quiet, obey=True, sig="SIGUSR2")  # registered below by "another writer"
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    procs = [term, usr1, usr2]
    try:
        for proc in procs:
            _wait_ready(proc)
        assert {p.name.split("-")[0] for p in pids.glob("*.json")} == {
            str(term.pid),
            str(usr1.pid),
        }
        # A minimal registration (no start time, no signals): the --signal fallback applies.
        (pids / f"{usr2.pid}-other.json").write_text(f'{{"pid": {usr2.pid}}}')
        gone = _gone_pid()
        (pids / f"{gone}-stale.json").write_text(f'{{"pid": {gone}, "signals": ["SIGTERM"]}}')
        # The bystander's pid with another start time: a recycled pid, never to be hit.
        state = read_proc_state(bystander.pid)
        assert state is not None and state.start_time is not None
        reused = f'{{"pid": {bystander.pid}, "start_time": {state.start_time - 1}}}'
        (pids / f"{bystander.pid}-reused.json").write_text(reused)

        env = dict(pod, REFIT_PREEMPTION_SIGNAL="usr2")
        done, took = _deliver(["refit-signal", "--timeout", "20"], env)

        assert done.returncode == 0, done.stderr
        assert took < 20
        assert f"sent SIGTERM to pid {term.pid}" in done.stdout
        assert f"sent SIGUSR1 to pid {usr1.pid}" in done.stdout
        assert f"sent SIGUSR2 to pid {usr2.pid}" in done.stdout
        assert f"skipping stale registration of pid {gone}" in done.stdout
        assert f"skipping stale registration of pid {bystander.pid}" in done.stdout
        assert "3 process(es) signalled, all exited" in done.stdout
        for proc in procs:
            assert proc.wait(timeout=10) == EXIT_PREEMPTED
        assert bystander.poll() is None  # not signalled
        # The listeners removed their own files on the way out; the stale ones were dropped.
        assert sorted(p.name for p in pids.iterdir()) == [f"{usr2.pid}-other.json"]
    finally:
        _stop_all([*procs, bystander])


def test_prestop_reports_what_did_not_exit(pod: dict[str, str]) -> None:
    stubborn = _start(pod, obey=False, sig="SIGTERM")
    try:
        _wait_ready(stubborn)
        argv = [sys.executable, "-m", "refit_worker.signals.delivery", "--timeout", "1.5"]
        done, took = _deliver(argv, pod)
        assert done.returncode == 1
        assert f"still running 1.5s after the signal: pid {stubborn.pid} (SIGTERM)" in done.stderr
        assert 1.5 <= took < 15  # bounded by --timeout, not by the process
        assert stubborn.poll() is None  # it caught the signal and carried on
    finally:
        _stop_all([stubborn])


def test_prestop_with_nobody_registered(pod: dict[str, str]) -> None:
    done, _ = _deliver(["refit-signal", "--timeout", "5"], pod)
    assert done.returncode == 0, done.stderr
    assert "0 process(es) signalled" in done.stdout
    assert signal.SIGTERM.name not in done.stdout  # nothing was sent
