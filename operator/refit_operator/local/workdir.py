"""The working directory of one ``refit run``: where pods' files, logs and the rendezvous live.

A run that owns its directory (no ``--workdir``) marks it with its pid and the start time
of its process, and removes it at the end.  A run killed with SIGKILL cannot remove its
own; the next run sweeps such directories whose owner is gone (its workers died with it:
see ``ProcessKubelet(die_with_parent=True)``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

#: Prefix of directories a run creates for itself under the system's temporary directory.
PREFIX = "refit-"
#: The marker file: "<pid> <process start time in clock ticks>".
OWNER_FILE = ".refit-run-owner"


class WorkdirError(ValueError):
    """``--workdir`` cannot be used; the message says why."""


def _start_ticks(pid: int) -> str | None:
    """Start time of ``pid`` since boot (field 22 of /proc/<pid>/stat), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def _owner_alive(marker: Path) -> bool:
    try:
        pid_text, ticks = marker.read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return True  # unreadable: not ours to judge, leave it
    # A recycled pid has another start time: its owner is gone all the same.
    return _start_ticks(pid) == ticks


def create_own(job: str, tmp: Path | None = None) -> Path:
    """A fresh directory for this run, marked as owned by this process."""
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{job}-", dir=tmp))
    (path / OWNER_FILE).write_text(f"{os.getpid()} {_start_ticks(os.getpid())}\n")
    return path


def sweep_stale(tmp: Path | None = None) -> list[Path]:
    """Remove run directories whose owning ``refit run`` is gone; returns what went."""
    base = Path(tmp or tempfile.gettempdir())
    removed = []
    for candidate in base.glob(f"{PREFIX}*"):
        marker = candidate / OWNER_FILE
        if candidate.is_dir() and marker.is_file() and not _owner_alive(marker):
            shutil.rmtree(candidate, ignore_errors=True)
            removed.append(candidate)
    return removed


def check_given(path: Path) -> Path:
    """``--workdir`` as an absolute path (pods run elsewhere), created if missing."""
    resolved = path.expanduser().resolve()
    if resolved.exists() and not resolved.is_dir():
        raise WorkdirError(f"--workdir {path}: exists and is not a directory")
    try:
        resolved.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WorkdirError(f"--workdir {path}: cannot create it: {exc.strerror or exc}") from exc
    if not os.access(resolved, os.W_OK | os.X_OK):
        raise WorkdirError(f"--workdir {path}: not writable")
    return resolved
