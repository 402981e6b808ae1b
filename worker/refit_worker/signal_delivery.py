"""Signal names, the pid registry, and ``refit-signal``: the preStop delivery command.

A process that enters ``DistributedSignalHandler`` while ``REFIT_SIGNAL_PID_DIR`` is set
writes one registration file into that directory (a shared emptyDir in a pod) and removes it
when it leaves.  A pod's preStop hook runs ``refit-signal --timeout N``; the command sends
every registered process the signal it listens for and waits, at most N seconds, for them
all to exit.  That lets the gang see a pod's termination even where the container runtime
cannot be told which signal to send (no ``lifecycle.stopSignal``).

Registration format: a file ``<pid>-<token>.json`` (written to a dot-named temp file, then
renamed, so readers never see half a file) holding a JSON object::

    {"version": 1, "pid": 4242, "start_time": 123456, "signals": ["SIGTERM"]}

``start_time`` is field 22 of ``/proc/<pid>/stat`` (clock ticks since boot); the command
signals a pid only while that still matches, so a recycled pid is never hit.  Both
``start_time`` and ``signals`` may be left out by other writers: then no reuse check is
possible, and the command's ``--signal`` is sent.

Must not import anything outside the standard library (not even ``refit_worker.config``,
which imports pydantic): this module runs as a preStop exec in any container.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

# Same strings as SIGNAL_PID_DIR_ENV / PREEMPTION_SIGNAL_ENV in refit_worker.config,
# repeated because that module imports pydantic (a unit test keeps the two in step).
SIGNAL_PID_DIR_ENV = "REFIT_SIGNAL_PID_DIR"
PREEMPTION_SIGNAL_ENV = "REFIT_PREEMPTION_SIGNAL"

REGISTRATION_VERSION = 1
DEFAULT_TIMEOUT_SECONDS = 25.0

SignalLike = int | str | signal.Signals


def resolve_signal(sig: SignalLike) -> signal.Signals:
    """Turn ``15``, ``signal.SIGTERM``, ``"SIGTERM"``, ``" term "`` into ``signal.SIGTERM``.

    Names are case-insensitive, with or without ``SIG``; decimal strings count as numbers
    (so a signal can be configured from YAML or env either way).  Raises ``TypeError`` for
    other types (``bool`` included: ``True`` is no signal) and ``ValueError`` naming the
    value when it names no signal on this platform.
    """
    if isinstance(sig, signal.Signals):
        return sig
    if isinstance(sig, bool) or not isinstance(sig, int | str):
        raise TypeError(
            f"a signal must be an int, a str or a signal.Signals, not {type(sig).__name__}"
            f" ({sig!r})"
        )
    if isinstance(sig, str):
        text = sig.strip()
        if text.isdecimal():
            return _signal_from_number(int(text), sig)
        name = text.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        member = signal.Signals.__members__.get(name)
        if member is None:
            raise ValueError(f"unknown signal name {sig!r}")
        return member
    return _signal_from_number(sig, sig)


def _signal_from_number(number: int, given: SignalLike) -> signal.Signals:
    try:
        return signal.Signals(number)
    except ValueError:
        raise ValueError(f"unknown signal number {given!r}") from None


def parse_signal_list(text: str) -> list[signal.Signals]:
    """Parse ``"SIGTERM,usr1"`` (the env / ``--signal`` form); empty or repeated → ValueError."""
    parts = text.split(",")
    if not text.strip() or any(not part.strip() for part in parts):
        raise ValueError(f"empty signal name in {text!r}")
    signals = [resolve_signal(part) for part in parts]
    repeated = sorted({s.name for s in signals if signals.count(s) > 1})
    if repeated:
        raise ValueError(f"signal(s) {', '.join(repeated)} given more than once in {text!r}")
    return signals


# --- the registry ---------------------------------------------------------------------


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
            f"{SIGNAL_PID_DIR_ENV}={os.fspath(directory)!r} is not an existing directory"
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


def read_registrations(directory: Path) -> tuple[list[Registration], list[str]]:
    """All registrations in ``directory``, and a problem line for each file that is not one."""
    found: list[Registration] = []
    problems: list[str] = []
    for path in sorted(directory.glob("*.json")):
        if path.name.startswith("."):
            continue
        try:
            found.append(parse_registration(path, path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            continue  # its process left between listing and reading
        except (ValueError, OSError) as exc:
            problems.append(str(exc))
    return found, problems


# --- deciding and delivering ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do: ``(pid, signal)`` pairs to send, and stale registrations to drop."""

    send: tuple[tuple[int, signal.Signals], ...]
    stale: tuple[Registration, ...]


def is_same_live_process(reg: Registration, proc: ProcState | None) -> bool:
    """Whether ``proc`` (what /proc says now) is still the process that registered."""
    if proc is None or proc.state in ("Z", "X"):
        return False  # gone, or a zombie waiting to be reaped: it has exited
    if reg.start_time is None or proc.start_time is None:
        return True  # nothing to compare: trust the pid
    return reg.start_time == proc.start_time


def plan_delivery(
    registrations: Iterable[Registration],
    fallback: signal.Signals,
    probe: Callable[[int], ProcState | None],
) -> Plan:
    """Decide, without side effects, which pid gets which signal.

    Each live registration's first signal is sent (one is enough to raise the handler's
    flag; a second one it does not catch could kill it outright); ``fallback`` stands in
    for a registration that names none.  Each ``(pid, signal)`` goes out once.
    """
    send: list[tuple[int, signal.Signals]] = []
    stale: list[Registration] = []
    for reg in registrations:
        if not is_same_live_process(reg, probe(reg.pid)):
            stale.append(reg)
            continue
        pair = (reg.pid, reg.signals[0] if reg.signals else fallback)
        if pair not in send:
            send.append(pair)
    return Plan(tuple(send), tuple(stale))


def deliver(
    directory: Path,
    fallback: signal.Signals,
    timeout: float,
    *,
    out: TextIO,
    err: TextIO,
    probe: Callable[[int], ProcState | None] = read_proc_state,
) -> int:
    """Signal every registered process and wait for all to exit; returns the exit code."""
    registrations, problems = read_registrations(directory)
    for problem in problems:
        print(f"refit-signal: skipping {problem}", file=err)
    plan = plan_delivery(registrations, fallback, probe)
    for reg in plan.stale:
        print(
            f"refit-signal: skipping stale registration of pid {reg.pid} ({reg.path.name})",
            file=out,
        )
        reg.path.unlink(missing_ok=True)
    by_pid = {reg.pid: reg for reg in registrations}
    waiting: dict[int, signal.Signals] = {}
    refused = 0
    for pid, sig in plan.send:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue  # exited since the check: nothing to wait for
        except PermissionError:
            print(f"refit-signal: not permitted to send {sig.name} to pid {pid}", file=err)
            refused += 1
            continue
        waiting[pid] = sig
        print(f"refit-signal: sent {sig.name} to pid {pid}", file=out)
    started = time.monotonic()
    deadline = started + timeout
    pause = 0.01
    while True:
        waiting = {p: s for p, s in waiting.items() if is_same_live_process(by_pid[p], probe(p))}
        if not waiting or time.monotonic() >= deadline:
            break
        # Bounded back-off: quick for fast exits, at most 5 wake-ups a second after that.
        time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause = min(pause * 2, 0.2)
    if waiting:
        left = ", ".join(f"pid {p} ({s.name})" for p, s in sorted(waiting.items()))
        print(
            f"refit-signal: {len(waiting)} process(es) still running {timeout:g}s after the"
            f" signal: {left}",
            file=err,
        )
        return 1
    if refused:
        return 1
    print(
        f"refit-signal: {len({pid for pid, _ in plan.send})} process(es) signalled, all exited in"
        f" {time.monotonic() - started:.2f}s",
        file=out,
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="refit-signal",
        description=(
            "Send the preemption signal to every process that registered in the pid"
            " directory (each gets the signal it registered for) and wait for them to exit."
            " Meant as a pod's preStop exec: refit-signal --timeout 25."
        ),
        epilog=(
            "Exit status: 0 when every signalled process exited (or none was registered),"
            " 1 when some were still running at the timeout, 2 on bad arguments."
        ),
    )
    parser.add_argument(
        "--dir",
        metavar="DIR",
        default=os.environ.get(SIGNAL_PID_DIR_ENV, ""),
        help=f"pid directory (default: ${SIGNAL_PID_DIR_ENV})",
    )
    parser.add_argument(
        "--signal",
        metavar="NAME[,NAME]",
        default=os.environ.get(PREEMPTION_SIGNAL_ENV) or "SIGTERM",
        help=(
            "signal for registrations that name none; the first is sent"
            f" (default: ${PREEMPTION_SIGNAL_ENV}, else SIGTERM)"
        ),
    )
    parser.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        help=f"seconds to wait for the signalled processes to exit (default: "
        f"{DEFAULT_TIMEOUT_SECONDS:g}); keep it below the pod's grace period",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``refit-signal`` and ``python -m refit_worker.signal_delivery``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.dir:
        parser.error(f"no pid directory: pass --dir or set {SIGNAL_PID_DIR_ENV}")
    directory = Path(args.dir)
    if not directory.is_dir():
        parser.error(f"pid directory {args.dir!r} does not exist or is not a directory")
    try:
        fallback = parse_signal_list(args.signal)[0]
    except ValueError as exc:
        parser.error(f"--signal: {exc}")
    if not math.isfinite(args.timeout) or args.timeout < 0:
        parser.error(f"--timeout must be a finite number of seconds >= 0, got {args.timeout!r}")
    return deliver(directory, fallback, args.timeout, out=sys.stdout, err=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
