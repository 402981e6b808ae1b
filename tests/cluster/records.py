"""Figures the cluster scenarios measured, printed at the end of the session so they can be
quoted (``conftest.pytest_terminal_summary``).  A module of its own: test modules and the
conftest must share one list, and a conftest may be imported under another module name.

Must not import: anything (plain data).
"""

from __future__ import annotations

LINES: list[tuple[str, str]] = []


def record(what: str, line: str) -> None:
    """Keep a line about ``what`` for the session's summary."""
    LINES.append((what, line))
