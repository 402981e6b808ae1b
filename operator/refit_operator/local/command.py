"""``refit run MANIFEST``: validate a RefitJob manifest, run it locally, show progress.

A bad manifest (YAML error, wrong kind, invalid spec, impossible topology) prints the
specific problem and starts nothing.  Ctrl-C (SIGINT), SIGTERM or a closed output pipe
stops every worker gracefully — the same termination path as a pod deletion — and removes
the run's files; workers die with this process even when it is killed outright, and the
next run removes what such a run left.

Exit codes: 0 success, 1 the job failed or timed out, 2 bad manifest or flags, 128+N
stopped by signal N (130 Ctrl-C, 143 SIGTERM, 141 when the output pipe closed).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from refit_operator.api import names
from refit_operator.api.models import RefitJobSpec, parse_spec
from refit_operator.core.decision import Emit
from refit_operator.local import (
    faults,
    ignored,
    metrics_ports,
    paths,
    preflight,
    sizing,
    status_file,
    view,
    workdir,
)
from refit_operator.local.manifest import ManifestError, load_manifest
from refit_operator.local.runner import LocalCluster, RunOptions, RunResult, run_job
from refit_worker.contract.synthetic import synthetic_nbytes

EXIT_FAILED, EXIT_BAD_MANIFEST = 1, 2
__all__ = [
    "EXIT_BAD_MANIFEST",
    "EXIT_FAILED",
    "ManifestError",
    "add_parser",
    "cmd_run",
    "load_manifest",
]


def _seconds(*, allow_zero: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds (argparse turns errors into usage)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number {bound}")
        return value

    return parse


def add_parser(sub: Any) -> None:
    """Register ``refit run`` on the ``refit`` command's subparsers."""
    run = sub.add_parser(
        "run",
        help="run a RefitJob on this machine (no cluster)",
        description="Run a RefitJob locally: the operator's rendering and reconcile, workers "
        "as local processes, a file-backed rendezvous, real NIXL transfers and real signals.",
        epilog=f"Exit codes: 0 the job succeeded, {EXIT_FAILED} it failed or timed out, "
        f"{EXIT_BAD_MANIFEST} bad manifest or arguments (nothing started), 128+N stopped by "
        f"signal N (Ctrl-C: {128 + signal.SIGINT}, SIGTERM: {128 + signal.SIGTERM}, "
        f"output pipe closed: {128 + signal.SIGPIPE}).",
    )
    run.add_argument("manifest", type=Path, help="RefitJob YAML, e.g. examples/local.yaml")
    _add_drain_arguments(run)
    faults.add_arguments(run)
    run.add_argument(
        "--timeout",
        type=_seconds(allow_zero=False),
        default=3600.0,
        metavar="SECONDS",
        help="stop every worker and give up after this long (default 3600)",
    )
    run.add_argument(
        "--workdir",
        type=Path,
        help="keep pod logs and rendezvous files here (default: a temporary "
        "directory removed at the end)",
    )
    run.add_argument(
        "--plain", action="store_true", help="log lines even on a terminal (no live view)"
    )
    run.add_argument(
        "--status-file",
        type=Path,
        metavar="PATH",
        help="at the end, whether the job succeeded or failed, write the final RefitJob "
        "(apiVersion, kind, metadata, spec and status) to PATH as JSON, as `kubectl get -o "
        "json` prints it; PATH's directory must exist and be writable (checked before "
        "anything starts)",
    )
    run.add_argument(
        "--claim",
        action="append",
        default=[],
        type=_claim,
        metavar="NAME=DIR",
        help="serve PersistentVolumeClaim NAME from local directory DIR (repeat); a "
        "safetensors job needs its weights.safetensors.claimName mapped",
    )
    run.add_argument(
        "--skip-resource-check",
        action="store_true",
        help="start even when the job looks too large for this machine",
    )
    run.set_defaults(func=cmd_run)


def _add_drain_arguments(run: Any) -> None:
    """The flags that simulate a node drain, one pod at a time."""
    run.add_argument(
        "--drain-after",
        type=_seconds(allow_zero=True),
        metavar="SECONDS",
        help="simulate a node drain on one pod this long after the gang first runs",
    )
    run.add_argument(
        "--drain-at-refit",
        type=faults.refit_number,
        metavar="N",
        help="simulate a node drain on one pod once N refits are committed (1 <= N < "
        "spec.transfer.refits): a policy pod's gang is preempted and a new one resumes at "
        "refit N; a rollout pod is replaced alone and stays (half its grace period at "
        "most) until its replacement, seeded from it or a peer, serves",
    )
    run.add_argument(
        "--drain-pod",
        metavar="POD",
        help="the rank to drain with --drain-after or --drain-at-refit, as <job>-<role>-<rank>"
        " or its first pod's name (default: <job>-rollout-0, whichever pod it runs in then)",
    )


def _claim(text: str) -> tuple[str, Path]:
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DIR")
    return name, Path(directory).expanduser().resolve()


class _Output:
    """stdout that survives its reader going away (``refit run ... | head``).

    A closed pipe asks the run to stop (every worker is stopped the usual way) and
    silences further output instead of raising in the middle of the loop.
    """

    def __init__(self, out: TextIO, on_closed: Callable[[], None]) -> None:
        self._out, self._on_closed = out, on_closed
        self.closed = False

    def write(self, text: str) -> None:
        if self.closed:
            return
        try:
            self._out.write(text)
            self._out.flush()
        except BrokenPipeError:
            self.closed = True
            # Python flushes stdout once more at exit; point it at nothing first.
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), self._out.fileno())
            self._on_closed()

    def line(self, text: str) -> None:
        self.write(text + "\n")


def _check_args(args: argparse.Namespace, job: str, spec: RefitJobSpec) -> str | None:
    """What is wrong with the flags for this job, or None."""
    if spec.suspend:
        return (
            "spec.suspend is true: a suspended job creates no pods until something sets "
            "suspend: false, and nothing does in a local run; set it to false to run here"
        )
    if args.drain_after is not None and args.drain_at_refit is not None:
        return "--drain-after and --drain-at-refit each say when to drain: give one of them"
    if args.drain_at_refit is not None and args.drain_at_refit >= spec.transfer.refits:
        return (
            f"--drain-at-refit {args.drain_at_refit}: the job does "
            f"{spec.transfer.refits} refit(s), so nothing would be left to resume after the "
            f"drain; use 1 to {spec.transfer.refits - 1}"
        )
    if args.drain_pod is not None:
        if args.drain_after is None and args.drain_at_refit is None:
            return (
                "--drain-pod names the pod to drain; it needs --drain-at-refit N or "
                "--drain-after SECONDS"
            )
        ranks = [f"{job}-policy-{r}" for r in range(spec.policy.replicas)]
        ranks += [f"{job}-rollout-{r}" for r in range(spec.rollout.replicas)]
        first = [names.pod_name(job, "policy", r, 0) for r in range(spec.policy.replicas)]
        first += [names.pod_name(job, "rollout", r, 0) for r in range(spec.rollout.replicas)]
        if args.drain_pod not in ranks + first:
            shown = ", ".join(ranks[:8]) + (", ..." if len(ranks) > 8 else "")
            return f"--drain-pod {args.drain_pod!r} is not a rank of job {job}: ranks are {shown}"
    drains = args.drain_after is not None or args.drain_at_refit is not None
    return faults.problem(faults.planned(args), spec, drains=drains)


def _claims(args: argparse.Namespace, spec: RefitJobSpec) -> tuple[dict[str, Path], int | None]:
    """The claim map, and the size of the model the job streams (None: unknown)."""
    claims = dict(args.claim)
    for name, directory in claims.items():
        if not directory.is_dir():
            raise ManifestError(f"--claim {name}={directory}: not a directory")
    source = spec.weights.safetensors
    if source is None:
        synthetic = spec.weights.synthetic
        return claims, synthetic_nbytes(synthetic) if synthetic is not None else None
    if source.claim_name not in claims:
        raise ManifestError(
            f"spec.weights.safetensors.claimName {source.claim_name!r}: a local run has no "
            f"PersistentVolumeClaims; map it to a directory with --claim "
            f"{source.claim_name}=DIR"
        )
    where = claims[source.claim_name] / source.path
    files = sorted(where.glob("*.safetensors"))
    if not files:
        raise ManifestError(f"no *.safetensors files in {where} (claim {source.claim_name})")
    problem = preflight.checkpoint_problem(files)
    if problem is not None:
        raise ManifestError(problem)
    return claims, sum(f.stat().st_size for f in files)


def _check_resources(args: argparse.Namespace, spec: RefitJobSpec, model: int | None) -> None:
    if args.skip_resource_check:
        return
    verdict, sentence = sizing.judge(
        sizing.estimate(spec, model), _available_memory(), len(os.sched_getaffinity(0))
    )
    if verdict == "refuse":
        raise ManifestError(sentence)
    if verdict == "warn":
        print(f"refit run: warning: {sentence}", file=sys.stderr)


def _available_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes (what the kernel can give without swap)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _prepare(
    args: argparse.Namespace,
) -> tuple[dict[str, Any], RefitJobSpec, dict[str, Path]]:
    """The manifest, spec and claim map, with the flags checked; ManifestError if not."""
    manifest, spec = load_manifest(args.manifest)
    local_spec, args.path_notes = paths.resolve(manifest["spec"], args.manifest.resolve().parent)
    if args.path_notes:
        manifest = {**manifest, "spec": local_spec}
        spec = parse_spec(local_spec)
    problem = _check_args(args, str(manifest["metadata"]["name"]), spec)
    if problem is None and args.status_file is not None:
        problem = status_file.problem(args.status_file)
    if problem is not None:
        raise ManifestError(problem)
    cannot = preflight.unhonourable(manifest["spec"])
    if cannot:
        raise ManifestError("; ".join(cannot))
    claims, model = _claims(args, spec)
    _check_resources(args, spec, model)
    most = faults.most_rollout_replicas(faults.planned(args), spec)
    scaled = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"replicas": most})})
    try:
        # Ports for every rank the run will have, a scale-up's included.
        args.metrics_ports = metrics_ports.plan(scaled, metrics_ports.loopback_free)
    except metrics_ports.PortsError as exc:
        raise ManifestError(str(exc)) from exc
    if args.workdir is not None:
        try:
            args.workdir = workdir.check_given(args.workdir)
        except workdir.WorkdirError as exc:
            raise ManifestError(str(exc)) from exc
    return manifest, spec, claims


def cmd_run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        manifest, spec, claims = _prepare(args)
    except ManifestError as exc:
        print(f"refit run: {exc}", file=sys.stderr)
        return EXIT_BAD_MANIFEST
    job = str(manifest["metadata"]["name"])
    live = out.isatty() and not args.plain
    started = time.monotonic()
    stop: dict[str, int] = {}

    def request_stop(signum: int, frame: object) -> None:
        stop.setdefault("signal", signum)

    def pipe_closed() -> None:
        stop.setdefault("signal", signal.SIGPIPE)

    printer = _Output(out, pipe_closed)
    _announce(printer, args, manifest, spec)
    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    drawn = [0]
    last_key: list[object] = [None]

    def on_event(event: Emit) -> None:
        _clear(printer, drawn)
        printer.line(view.event_line(event, time.monotonic() - started))

    def on_tick(status: Any, cluster: LocalCluster) -> None:
        elapsed = time.monotonic() - started
        if live:
            _clear(printer, drawn)
            width = shutil.get_terminal_size().columns
            lines = view.fit(view.live_lines(job, spec, status, elapsed), width)
            printer.write("\n".join(lines) + "\n")
            drawn[0] = len(lines)
        elif view.status_key(status) != last_key[0]:
            last_key[0] = view.status_key(status)
            printer.line(view.status_line(job, spec, status, elapsed))

    try:
        result = run_job(
            manifest,
            spec,
            _run_options(args, claims),
            on_tick=on_tick,
            on_event=on_event,
            should_stop=lambda: "signal" in stop,
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _clear(printer, drawn)
    code = _summarise(
        printer, args, job=job, spec=spec, result=result, started=started, signum=stop.get("signal")
    )
    return _write_status_file(args, manifest, result, code)


def _write_status_file(
    args: argparse.Namespace, manifest: Mapping[str, Any], result: RunResult, code: int
) -> int:
    """``--status-file``: the final RefitJob, whatever the outcome; a file that cannot be
    written (its directory went away during the run) fails a run that would have passed."""
    if args.status_file is None:
        return code
    try:
        status_file.write(
            args.status_file, status_file.job_object(manifest, result.job, result.status)
        )
    except OSError as exc:
        print(f"refit run: --status-file {args.status_file}: {exc}", file=sys.stderr)
        return code or EXIT_FAILED
    return code


def _announce(
    printer: _Output, args: argparse.Namespace, manifest: dict[str, Any], spec: RefitJobSpec
) -> None:
    """Before anything starts: what an earlier killed run left, and what this run is."""
    for stale in workdir.sweep_stale():
        printer.line(f"refit run: removed {stale}, left by an earlier run that was killed")
    for line in _opening_lines(args, manifest, spec):
        printer.line(line)


def _run_options(args: argparse.Namespace, claims: Mapping[str, Path]) -> RunOptions:
    return RunOptions(
        workdir=args.workdir,
        drain_after=args.drain_after,
        drain_at_refit=args.drain_at_refit,
        drain_pod=args.drain_pod,
        timeout=args.timeout,
        claims=claims,
        metrics_ports=args.metrics_ports,
        faults=faults.planned(args),
    )


def _summarise(
    printer: _Output,
    args: argparse.Namespace,
    *,
    job: str,
    spec: RefitJobSpec,
    result: RunResult,
    started: float,
    signum: int | None,
) -> int:
    """The run's summary lines; returns the exit status of ``refit run``."""
    elapsed = time.monotonic() - started
    for line in view.summary(job, spec, result, elapsed):
        printer.line(line)
    note = _undrained_note(args, result)
    if note is not None:
        printer.line(note)
    for line in view.fault_lines(faults.planned(args), result):
        printer.line(line)
    if result.interrupted:
        signum = signum or signal.SIGINT
        printer.line(
            f"refit run: stopped by {signal.Signals(signum).name}; every worker was stopped"
        )
        return 128 + signum
    return 0 if result.succeeded else EXIT_FAILED


def _opening_lines(
    args: argparse.Namespace, manifest: dict[str, Any], spec: RefitJobSpec
) -> list[str]:
    """What the run is, what it ignores, where the metrics are."""
    job = str(manifest["metadata"]["name"])
    lines = [
        f"refit run: {job}: {spec.policy.replicas} policy -> {spec.rollout.replicas} "
        f"rollout rank(s), {spec.transfer.refits} refit(s), bucket {spec.transfer.bucket_size}",
        ignored.ignored_line(manifest["spec"]),
    ]
    if args.path_notes:
        lines.append(
            "refit run: read from the manifest's directory (pods run in directories of "
            "their own): " + "; ".join(args.path_notes)
        )
    if args.metrics_ports:
        lines.append(metrics_ports.describe(job, args.metrics_ports))
    return lines


def _undrained_note(args: argparse.Namespace, result: RunResult) -> str | None:
    """Why a drain that was asked for did not happen or changed nothing, or None."""
    if result.interrupted:
        return None
    if result.drained is not None:
        late = (
            result.succeeded
            and "-rollout-" in result.drained
            and result.status.rollout.replacements == 0
        )
        if late:
            # The runner looks between rounds: on a starved machine the pod may finish
            # its last refit before the drain reaches it, and a finished slot needs no one.
            return (
                f"refit run: note: the drain reached {result.drained} after it had "
                "committed every refit: no replacement was needed (give the job a "
                "weights.synthetic.pace or more refits to see one)"
            )
        return None
    if args.drain_at_refit is not None:
        return (
            f"refit run: note: nothing was drained: the job ended before "
            f"{args.drain_at_refit} refit(s) were committed"
        )
    if args.drain_after is not None:
        return (
            f"refit run: note: nothing was drained: the job ended before --drain-after "
            f"{args.drain_after:g}s had passed with its gang running"
        )
    return None


def _clear(out: _Output, drawn: list[int]) -> None:
    """Erase the live block (cursor up n lines, clear to end of screen)."""
    if drawn[0]:
        out.write(f"\x1b[{drawn[0]}F\x1b[J")
        drawn[0] = 0
