"""The engines tier: real inference engines, each in its own cached environment.

``install.sh`` makes (or finds cached) the vLLM environment once collection says the tier
will run (so a cold install's minutes are not charged to a test's timeout) and prints how
long it took; a failed install fails every test of the tier with install.sh's own
message: this tier never skips.  Engine-side code runs in that environment's Python as
subprocesses, with this checkout's ``worker/`` on ``PYTHONPATH`` (kube-refit is not
installed into the cached environment, so it can never run a stale copy).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
INSTALL_TIMEOUT_S = 1800
_SESSION: dict[str, Any] = {}


def _in_tier(item: pytest.Item) -> bool:
    return HERE in item.path.parents


def install() -> Path:
    """The vLLM environment's directory (install.sh's stdout); RuntimeError with its
    stderr when it fails."""
    done = subprocess.run(
        ["bash", str(HERE / "install.sh")],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"tests/engines/install.sh failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
        )
    return Path(done.stdout.strip().splitlines()[-1])


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any(_in_tier(item) for item in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    started = time.monotonic()
    try:
        _SESSION["venv"] = install()
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        _SESSION["error"] = exc
    _SESSION["install_s"] = time.monotonic() - started
    _SESSION["started"] = time.monotonic()
    if reporter is not None:
        reporter.write_line(
            f"engines tier: vLLM environment ready after {_SESSION['install_s']:.0f} s "
            "(tests/engines/install.sh)"
        )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if "started" in _SESSION:
        terminalreporter.write_line(
            f"engines tier: install {_SESSION['install_s']:.0f} s, tests "
            f"{time.monotonic() - _SESSION['started']:.0f} s"
        )


@pytest.fixture(scope="session")
def engine_python() -> Path:
    """The vLLM environment's Python."""
    if "error" in _SESSION:
        raise _SESSION["error"]
    if "venv" not in _SESSION:  # collected without the hook (e.g. a plugin reordered it)
        _SESSION["venv"] = install()
    return Path(_SESSION["venv"]) / "bin" / "python"


def engine_env(**extra: str) -> dict[str, str]:
    """The environment of an engine-side subprocess: this checkout's worker and tests."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "worker"), str(ROOT)])
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env
