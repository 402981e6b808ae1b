"""``python examples/signal_gang.py``: the signal handler stopping a real gloo gang together.

An example of the worker library, not part of it.  The parent hosts a ``TCPStore`` on a
free port and starts N rank processes (plain subprocesses running this script with
``--worker-rank``).  Each rank runs a toy training
loop (one ``all_reduce`` a step) inside ``DistributedSignalHandler`` and polls
``signals_received()`` at every step boundary.  When the chosen rank reaches the chosen
step it says so and waits; the parent sends it the signal with ``os.kill`` and lets it go
on.  Every rank must then see exactly that rank flagged at that same step, and exit with
``EXIT_PREEMPTED``.

Ranks talk to the parent in JSON lines (stdout) and a one-line reply (stdin), nothing else.
``tests/e2e/test_signal_gang.py`` runs it; ``tests/unit/test_signal_demo.py`` checks its
verdict and its argument checks.

Must not import: the operator, nixl, kubernetes.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

# torch.distributed re-exports TCPStore implicitly only (mypy strict rejects that); this is
# where it is defined and typed.
from torch._C._distributed_c10d import TCPStore

from refit_worker.contract.exits import EXIT_PREEMPTED
from refit_worker.signals.handler import DistributedSignalHandler, resolve_signal

_SCRIPT = Path(__file__).resolve()
#: A checkout's worker source root, so the ranks import refit_worker installed or not.
_WORKER_ROOT = _SCRIPT.parents[1] / "worker"


@dataclass(frozen=True, slots=True)
class DemoSettings:
    """One demo run: gang size, loop length, and when and where the signal goes."""

    ranks: int = 3
    steps: int = 30
    signal_rank: int = 1
    signal_at: int = 5
    sig: signal.Signals = signal.SIGTERM
    step_seconds: float = 0.02
    timeout: float = 60.0


@dataclass(slots=True)
class RankReport:
    """How one rank ended: where it stopped, what it saw there, its exit code."""

    rank: int
    pid: int
    stopped_at: int | None = None
    seen: list[bool] = field(default_factory=list)
    polls_before: int = 0
    exit_code: int | None = None


@dataclass(frozen=True, slots=True)
class DemoResult:
    """All ranks' reports for one run, and whether they match what the settings imply."""

    settings: DemoSettings
    reports: tuple[RankReport, ...]

    def problems(self) -> list[str]:
        """Every way the ranks failed to stop together (empty: they did)."""
        s = self.settings
        expected = [rank == s.signal_rank for rank in range(s.ranks)]
        found: list[str] = []
        for r in self.reports:
            if r.stopped_at != s.signal_at:
                found.append(f"rank {r.rank} stopped at step {r.stopped_at}, not {s.signal_at}")
            if r.seen != expected:
                found.append(f"rank {r.rank} saw {r.seen}, expected {expected}")
            if r.polls_before != s.signal_at:
                found.append(f"rank {r.rank} made {r.polls_before} clean polls, not {s.signal_at}")
            if r.exit_code != EXIT_PREEMPTED:
                found.append(f"rank {r.rank} exited {r.exit_code}, not {EXIT_PREEMPTED}")
        return found


def run_demo(settings: DemoSettings, out: TextIO = sys.stdout) -> DemoResult:
    """Start the ranks, signal one mid-loop, collect how each stopped (bounded by timeout)."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
    procs = [_spawn(rank, store.port, settings, events) for rank in range(settings.ranks)]
    reports = [RankReport(rank, proc.pid) for rank, proc in enumerate(procs)]
    deadline = time.monotonic() + settings.timeout
    try:
        open_ranks = set(range(settings.ranks))
        while open_ranks:
            try:
                rank, event = events.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise TimeoutError(
                    f"demo: waited {settings.timeout:g}s for ranks {sorted(open_ranks)} to stop"
                ) from None
            _on_event(event, procs[rank], reports[rank], settings, out)
            if event["event"] in ("stopped", "finished", "eof"):
                open_ranks.discard(rank)
        for rank, proc in enumerate(procs):
            reports[rank].exit_code = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    return DemoResult(settings, tuple(reports))


def _spawn(
    rank: int,
    port: int,
    s: DemoSettings,
    events: queue.Queue[tuple[int, dict[str, Any]]],
) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_WORKER_ROOT), env.get("PYTHONPATH")]))
    argv = [sys.executable, str(_SCRIPT), "--worker-rank", str(rank)]
    argv += ["--store-port", str(port), "--ranks", str(s.ranks), "--steps", str(s.steps)]
    argv += ["--signal-rank", str(s.signal_rank), "--signal-at", str(s.signal_at)]
    argv += ["--signal", s.sig.name, "--step-seconds", str(s.step_seconds)]
    argv += ["--timeout", str(s.timeout)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    if proc.stdout is None or proc.stdin is None:
        raise RuntimeError(f"rank {rank}: subprocess started without its pipes")
    threading.Thread(target=_read_events, args=(rank, proc.stdout, events), daemon=True).start()
    return proc


def _read_events(
    rank: int, stream: TextIO, events: queue.Queue[tuple[int, dict[str, Any]]]
) -> None:
    for line in stream:
        try:
            events.put((rank, json.loads(line)))
        except json.JSONDecodeError:
            print(f"[rank {rank}] {line.rstrip()}", file=sys.stderr)
    events.put((rank, {"event": "eof"}))


def _on_event(
    event: dict[str, Any],
    proc: subprocess.Popen[str],
    report: RankReport,
    s: DemoSettings,
    out: TextIO,
) -> None:
    kind, rank = event["event"], report.rank
    if kind == "ready" and proc.stdin is not None:
        os.kill(proc.pid, s.sig)
        print(
            f"demo: step {event['step']}: sent {s.sig.name} to rank {rank} (pid {proc.pid})",
            file=out,
        )
        proc.stdin.write("sent\n")
        proc.stdin.flush()
    elif kind in ("stopped", "finished"):
        report.stopped_at = event["step"]
        report.seen = list(event["seen"])  # as sent: JSON keeps bool apart from 0/1
        report.polls_before = event["polls_before"]
        flagged = [i for i, flag in enumerate(report.seen) if flag]
        print(
            f"rank {rank}: {'stopped' if kind == 'stopped' else 'ran out'} at step"
            f" {report.stopped_at}; signal seen on rank(s) {flagged}",
            file=out,
            flush=True,
        )


# --- inside a rank --------------------------------------------------------------------


def _emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _wait_for_parent(timeout: float) -> None:
    readable, _, _ = select.select([sys.stdin], [], [], timeout)
    if not readable or sys.stdin.readline().strip() != "sent":
        raise TimeoutError(f"rank waited {timeout:g}s for the demo to send the signal")


def run_rank(rank: int, store_port: int, s: DemoSettings) -> int:
    """One rank's toy training loop; returns its exit code."""
    limit = timedelta(seconds=s.timeout)
    store = TCPStore("127.0.0.1", store_port, is_master=False, timeout=limit)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=s.ranks, timeout=limit)
    weights = torch.zeros(8)
    try:
        with DistributedSignalHandler(s.sig) as handler:
            for step in range(s.steps):
                grad = torch.full((8,), float(rank + 1))
                dist.all_reduce(grad)  # the "training step": a real collective
                weights -= 0.01 * grad
                if rank == s.signal_rank and step == s.signal_at:
                    _emit(event="ready", step=step)
                    _wait_for_parent(s.timeout)
                seen = handler.signals_received()
                if any(seen):
                    # A real trainer would save a checkpoint here, then exit.
                    _emit(event="stopped", step=step, seen=seen, polls_before=step)
                    return EXIT_PREEMPTED
                time.sleep(s.step_seconds)
            _emit(event="finished", step=s.steps, seen=[False] * s.ranks, polls_before=s.steps)
            return 0
    finally:
        dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    d = DemoSettings()
    p = argparse.ArgumentParser(
        prog="python examples/signal_gang.py",
        description="Start a gang of gloo ranks running a toy loop inside"
        " DistributedSignalHandler, signal one rank mid-loop, and check that every rank"
        " stops at that same step. Exit 0 when they agree, 1 when not.",
    )
    p.add_argument("--ranks", type=int, default=d.ranks, help="gang size (default %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="loop length (default %(default)s)")
    p.add_argument("--signal-rank", type=int, default=d.signal_rank, help="rank to signal")
    p.add_argument("--signal-at", type=int, default=d.signal_at, help="step to signal it at")
    p.add_argument("--signal", default=d.sig.name, help="signal name (default %(default)s)")
    p.add_argument("--step-seconds", type=float, default=d.step_seconds, help="sleep per step")
    p.add_argument("--timeout", type=float, default=d.timeout, help="bound on the whole run")
    p.add_argument("--worker-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    return p


def settings_from_args(args: argparse.Namespace) -> DemoSettings:
    """Validate the command line; ``ValueError`` names the first bad value."""
    if args.ranks < 1:
        raise ValueError(f"--ranks must be at least 1, got {args.ranks}")
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if not 0 <= args.signal_rank < args.ranks:
        raise ValueError(f"--signal-rank must be in [0, {args.ranks}), got {args.signal_rank}")
    if not 0 <= args.signal_at < args.steps:
        raise ValueError(f"--signal-at must be in [0, {args.steps}), got {args.signal_at}")
    if not args.step_seconds >= 0:
        raise ValueError(f"--step-seconds must be >= 0, got {args.step_seconds}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    sig = resolve_signal(args.signal)
    return DemoSettings(
        args.ranks,
        args.steps,
        args.signal_rank,
        args.signal_at,
        sig,
        args.step_seconds,
        args.timeout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo (or, with the hidden ``--worker-rank``, one of its ranks)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.worker_rank is not None:
        return run_rank(args.worker_rank, args.store_port, settings)
    started = time.monotonic()
    result = run_demo(settings)
    problems = result.problems()
    for problem in problems:
        print(f"demo: FAILED: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(
        f"demo: all {settings.ranks} ranks stopped together at step {settings.signal_at}"
        f" after {settings.sig.name} to rank {settings.signal_rank}"
        f" ({time.monotonic() - started:.1f}s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
