"""Test tiers by folder: ``unit/`` (pure), ``integration/`` (API emulator + kopf in-loop),
``e2e/`` (real processes, real NIXL, real signals), ``cluster/`` (a real Kubernetes
control plane built from source, process nodes, the operator as a process);
``engines/`` (real inference engines: vLLM's CPU build in its own cached environment);
``reliability/`` (fault injection on real processes) counts as e2e.  Each test gets its
tier's marker, so ``-m unit`` selects the fast tier; CI runs all of them.  ``gpu/`` holds
the CUDA tier in files named ``gpu_*.py``, which a plain run does not collect:
``bench/gpu_check.sh`` runs them on a GPU machine, where they fail (never skip) without
CUDA.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_TIERS = ("unit", "integration", "e2e", "cluster", "engines")


def pytest_configure(config: pytest.Config) -> None:
    # Every process a test starts inherits this: a native crash (SIGSEGV, SIGABRT) in a
    # child then leaves its Python stacks on the stderr the test captures (one child once
    # ended -6 with stderr empty, and nothing said where).
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        for tier in _TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
        if "reliability" in parts:
            item.add_marker(pytest.mark.e2e)


# Seconds per tier (setup + call + teardown of its tests; a module fixture's start counts
# with the first test that uses it), printed at the end of the run: the budgets of
# docs/testing.md are per tier, and the 20 slowest tests alone do not show a tier's total.
_TIER_SECONDS: dict[str, float] = {}
_TIER_TESTS: dict[str, int] = {}


def tier_of(nodeid: str) -> str:
    """The tier a test's node id falls in by its folder (reliability apart from e2e here:
    its budget is its own), or ``other``."""
    parts = Path(nodeid.split("::", 1)[0]).parts
    for tier in ("reliability", *_TIERS):
        if tier in parts:
            return tier
    return "other"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = tier_of(report.nodeid)
    _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration
    if report.when == "call":
        _TIER_TESTS[tier] = _TIER_TESTS.get(tier, 0) + 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _TIER_SECONDS:
        return
    terminalreporter.write_sep("=", "seconds per tier")
    for tier, seconds in sorted(_TIER_SECONDS.items(), key=lambda kv: -kv[1]):
        tests = _TIER_TESTS.get(tier, 0)
        terminalreporter.write_line(f"{seconds:8.0f}s  {tier} ({tests} tests)")
