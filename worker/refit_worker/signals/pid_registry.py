"""The pid registry: processes inside ``DistributedSignalHandler`` say which signal they want.

A process that enters ``DistributedSignalHandler(..., pid_dir=DIR)`` (in a pod: ``DIR`` is
``REFIT_SIGNAL_PID_DIR``, a shared emptyDir) writes one registration file there and removes
it when it leaves.  The preStop command ``refit-signal`` (:mod:`refit_worker.signals.delivery`)
reads them and sends each process its signal.

Registration format: a file ``<pid>-<token>.json`` (written to a dot-named temp file, then
renamed, so readers never see half a file) holding a JSON object::

    {"version": 1, "pid": 4242, "start_time": 123456, "signals": ["SIGTERM"]}

``start_time`` is field 22 of ``/proc/<pid>/stat`` (clock ticks since boot); a process is
taken for the registered one only while that still matches, so a recycled pid is never hit.
Both ``start_time`` and ``signals`` may be left out by other writers: then no reuse check
is possible, and the command's ``--signal`` is sent.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from refit_worker.contract.env import SIGNAL_PID_DIR_ENV
from refit_worker.contract.signals import resolve_signal

REGISTRATION_VERSION = 1

_HAVE_PROC = os.path.exists("/proc/self/stat")


@dataclass(frozen=True, slots=True)
class ProcState:
    """What ``/proc/<pid>/stat`` says about a process: its state letter and start time."""

    state: str
    start_time: int | None


@dataclass(frozen=True, slots=True)
class Registration:
    """One registration file: a pid, its start time if known, the signals it listens for."""

    path: Path
    pid: int
    start_time: int | None
    signals: tuple[signal.Signals, ...]


def read_proc_state(pid: int) -> ProcState | None:
    """The state of ``pid`` from ``/proc``, or ``None`` when there is no such process."""
    if not _HAVE_PROC:
        # No /proc (not Linux): liveness only, so no guard against a recycled pid.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # it exists, owned by someone else
        return ProcState(state="?", start_time=None)
    try:
        raw = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    return ProcState(state=fields[0], start_time=int(fields[19]))


def register(directory: str | os.PathLike[str], signals: Sequence[signal.Signals]) -> Path:
    """Register this process as listening for ``signals``; returns the file to remove later."""
    folder = Path(directory)
    if not folder.is_dir():
        raise NotADirectoryError(
            f"pid directory {os.fspath(directory)!r} ({SIGNAL_PID_DIR_ENV} in a pod) is not"
            " an existing directory"
        )
    pid = os.getpid()
    proc = read_proc_state(pid)
    record = {
        "version": REGISTRATION_VERSION,
        "pid": pid,
        "start_time": proc.start_time if proc else None,
        "signals": [s.name for s in signals],
    }
    # A token per registration, so nested handlers in one process each own their file.
    name = f"{pid}-{secrets.token_hex(4)}.json"
    temp = folder / f".{name}.tmp"
    temp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(temp, folder / name)
    return folder / name


def parse_registration(path: Path, text: str) -> Registration:
    """Parse one registration file's text; ``ValueError`` says what is wrong with it."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    pid = data.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid < 1:
        # 0 and negative pids would make os.kill signal whole process groups.  Pid 1 is
        # fine: a trainer is often the container's first process, and its handler is set.
        raise ValueError(f"{path}: pid must be a positive integer, got {pid!r}")
    start = data.get("start_time")
    if start is not None and (isinstance(start, bool) or not isinstance(start, int)):
        raise ValueError(f"{path}: start_time must be an integer or null, got {start!r}")
    names = data.get("signals") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{path}: signals must be a list of names, got {names!r}")
    try:
        signals = tuple(resolve_signal(n) for n in names)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return Registration(path, pid, start, signals)


#: A registration is ~100 bytes; anything much larger is not one.
MAX_REGISTRATION_BYTES = 4096


def _read_registration_file(path: Path) -> str:
    """The file's text, refusing what is not a small regular UTF-8 file.

    Non-blocking and no symlinks: a FIFO or a device named ``*.json`` in the shared
    directory must not hang the preStop hook, nor send it reading elsewhere.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: not a regular file")
        if info.st_size > MAX_REGISTRATION_BYTES:
            raise ValueError(
                f"{path}: {info.st_size} bytes, over the {MAX_REGISTRATION_BYTES}-byte limit"
            )
        data = os.read(fd, MAX_REGISTRATION_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def read_registrations(directory: Path) -> tuple[list[Registration], list[str]]:
    """All registrations in ``directory``, and a problem line for each file that is not one."""
    found: list[Registration] = []
    problems: list[str] = []
    for path in sorted(directory.glob("*.json")):
        if path.name.startswith("."):
            continue
        try:
            found.append(parse_registration(path, _read_registration_file(path)))
        except FileNotFoundError:
            continue  # its process left between listing and reading
        except (ValueError, OSError) as exc:
            problems.append(str(exc))
    return found, problems


def is_same_live_process(reg: Registration, proc: ProcState | None) -> bool:
    """Whether ``proc`` (what /proc says now) is still the process that registered."""
    if proc is None or proc.state in ("Z", "X"):
        return False  # gone, or a zombie waiting to be reaped: it has exited
    if reg.start_time is None or proc.start_time is None:
        return True  # nothing to compare: trust the pid
    return reg.start_time == proc.start_time
