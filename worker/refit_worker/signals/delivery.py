"""``refit-signal``: the preStop delivery command.

A pod's preStop hook runs ``refit-signal --timeout N``; the command reads the pid registry
(:mod:`refit_worker.signals.pid_registry`), sends every registered process the signal it listens
for and waits, at most N seconds, for them all to exit.  That lets the gang see a pod's
termination even where the container runtime cannot be told which signal to send (no
``lifecycle.stopSignal``).  :func:`plan_delivery` decides (pure), :func:`deliver` does.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from refit_worker.contract.env import PREEMPTION_SIGNAL_ENV, SIGNAL_PID_DIR_ENV
from refit_worker.contract.signals import parse_signal_list
from refit_worker.contract.waits import Backoff, WaitTimeout, poll_until
from refit_worker.signals.pid_registry import (
    ProcState,
    Registration,
    is_same_live_process,
    read_proc_state,
    read_registrations,
)

DEFAULT_TIMEOUT_SECONDS = 25.0
#: Quick for fast exits, at most 5 wake-ups a second after that.
_EXIT_BACKOFF = Backoff(first=0.01, cap=0.2)


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do: ``(pid, signal)`` pairs to send, and stale registrations to drop."""

    send: tuple[tuple[int, signal.Signals], ...]
    stale: tuple[Registration, ...]


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
    waiting, refused = _send_all(plan, out=out, err=err)
    started = time.monotonic()
    if not _wait_exited(waiting, {reg.pid: reg for reg in registrations}, timeout, probe, err):
        return 1
    if refused:
        return 1
    print(
        f"refit-signal: {len({pid for pid, _ in plan.send})} process(es) signalled, all exited in"
        f" {time.monotonic() - started:.2f}s",
        file=out,
    )
    return 0


def _send_all(plan: Plan, *, out: TextIO, err: TextIO) -> tuple[dict[int, signal.Signals], int]:
    """Send the plan's signals: the processes to wait for, and how many refused one."""
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
    return waiting, refused


def _wait_exited(
    waiting: dict[int, signal.Signals],
    by_pid: dict[int, Registration],
    timeout: float,
    probe: Callable[[int], ProcState | None],
    err: TextIO,
) -> bool:
    """Wait up to ``timeout`` for every signalled process to exit (a reused pid counts as
    exited); False, with the ones still running named on ``err``, if some did not."""

    def all_exited() -> bool:
        for pid in [p for p in waiting if not is_same_live_process(by_pid[p], probe(p))]:
            del waiting[pid]
        return not waiting

    try:
        poll_until(
            all_exited,
            timeout=timeout,
            what=f"{len(waiting)} signalled process(es) to exit",
            backoff=_EXIT_BACKOFF,
        )
    except WaitTimeout:
        left = ", ".join(f"pid {p} ({s.name})" for p, s in sorted(waiting.items()))
        print(
            f"refit-signal: {len(waiting)} process(es) still running {timeout:g}s after the"
            f" signal: {left}",
            file=err,
        )
        return False
    return True


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
    """Entry point of ``refit-signal`` and ``python -m refit_worker.signals.delivery``."""
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
