"""The engines tier: real inference engines, each in its own cached environment.

``install.sh`` makes (or finds cached) the vLLM environment once collection says the tier
will run (so a cold install's minutes are not charged to a test's timeout) and prints how
long it took; a failed install fails every test of the tier with install.sh's own
message: this tier never skips.  Engine-side code runs in that environment's Python as
subprocesses, with this checkout's ``worker/`` on ``PYTHONPATH`` (kube-refit is not
installed into the cached environment, so it can never run a stale copy).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from tests.engines.environment import HERE, install

_SESSION: dict[str, Any] = {}


def _in_tier(item: pytest.Item) -> bool:
    return HERE in item.path.parents


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
    if reporter is not None:
        reporter.write_line(
            f"engines tier: vLLM environment ready after {_SESSION['install_s']:.0f} s "
            "(tests/engines/install.sh)"
        )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add up the tier's own time (set-up, call, tear-down of its tests)."""
    if report.nodeid.startswith(f"{HERE.parent.name}/{HERE.name}/"):
        _SESSION["run_s"] = _SESSION.get("run_s", 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if "install_s" in _SESSION:
        terminalreporter.write_line(
            f"engines tier: install {_SESSION['install_s']:.0f} s, tests "
            f"{_SESSION.get('run_s', 0.0):.0f} s"
        )


@pytest.fixture(scope="session")
def engine_python() -> Path:
    """The vLLM environment's Python."""
    if "error" in _SESSION:
        raise _SESSION["error"]
    if "venv" not in _SESSION:  # collected without the hook (e.g. a plugin reordered it)
        _SESSION["venv"] = install()
    return Path(_SESSION["venv"]) / "bin" / "python"
