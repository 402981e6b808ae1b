"""``refit run MANIFEST``: validate a RefitJob manifest, run it locally, show progress.

A bad manifest (YAML error, wrong kind, invalid spec, impossible topology) prints the
specific problem and starts nothing.  Ctrl-C (SIGINT) or SIGTERM stops every worker
gracefully — the same termination path as a pod deletion — and removes the run's files.

Exit codes: 0 success, 1 the job failed or timed out, 2 bad manifest, 130 interrupted.

Must not import: kopf, kubernetes.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import yaml

from refit_operator import names
from refit_operator.local import view
from refit_operator.local.runner import LocalCluster, RunOptions, run_job
from refit_operator.models import API_VERSION, InvalidSpecError, RefitJobSpec, parse_spec
from refit_operator.reconcile import Emit

EXIT_FAILED, EXIT_BAD_MANIFEST, EXIT_INTERRUPTED = 1, 2, 130


class ManifestError(ValueError):
    """The file is not a valid RefitJob manifest; the message says where and why."""


def load_manifest(path: Path) -> tuple[dict[str, Any], RefitJobSpec]:
    """Read and validate a RefitJob manifest exactly as the operator would."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: not valid YAML: {exc}") from exc
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == "RefitJob"]
    if len(jobs) != 1:
        raise ManifestError(
            f"{path}: expected exactly one object of kind RefitJob, found {len(jobs)}"
        )
    manifest = jobs[0]
    expected = API_VERSION
    if manifest.get("apiVersion") != expected:
        raise ManifestError(
            f"{path}: apiVersion is {manifest.get('apiVersion')!r}, expected {expected!r}"
        )
    meta = manifest.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        raise ManifestError(f"{path}: metadata.name is required")
    try:
        spec = parse_spec(manifest.get("spec"))
    except InvalidSpecError as exc:
        raise ManifestError(f"{path}: invalid spec: {exc}") from exc
    problems = names.name_problems(meta["name"], spec.policy.replicas, spec.rollout.replicas)
    if problems:
        raise ManifestError(f"{path}: metadata.name: {'; '.join(problems)}")
    return manifest, spec


def add_parser(sub: Any) -> None:
    """Register ``refit run`` on the ``refit`` command's subparsers."""
    run = sub.add_parser(
        "run",
        help="run a RefitJob on this machine (no cluster)",
        description="Run a RefitJob locally: the operator's rendering and reconcile, workers "
        "as local processes, a file-backed rendezvous, real NIXL transfers and real signals.",
    )
    run.add_argument("manifest", type=Path, help="RefitJob YAML, e.g. examples/local.yaml")
    run.add_argument(
        "--drain-after",
        type=float,
        metavar="SECONDS",
        help="simulate a node drain on one pod this long after the gang runs",
    )
    run.add_argument(
        "--drain-pod", metavar="POD", help="the pod to drain (default: <job>-rollout-0)"
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="give up after this long (default 3600)",
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
    run.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        manifest, spec = load_manifest(args.manifest)
    except ManifestError as exc:
        print(f"refit run: {exc}", file=sys.stderr)
        return EXIT_BAD_MANIFEST
    if args.drain_after is not None and args.drain_after < 0:
        print("refit run: --drain-after must be >= 0 seconds", file=sys.stderr)
        return EXIT_BAD_MANIFEST
    job = str(manifest["metadata"]["name"])
    live = out.isatty() and not args.plain
    started = time.monotonic()
    stop = {"requested": False}

    def request_stop(signum: int, frame: object) -> None:
        stop["requested"] = True

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    drawn = [0]
    last_key: list[object] = [None]

    def on_event(event: Emit) -> None:
        _clear(out, drawn)
        print(view.event_line(event, time.monotonic() - started), file=out, flush=True)

    def on_tick(status: Any, cluster: LocalCluster) -> None:
        elapsed = time.monotonic() - started
        if live:
            _clear(out, drawn)
            lines = view.live_lines(job, spec, status, elapsed)
            out.write("\n".join(lines) + "\n")
            out.flush()
            drawn[0] = len(lines)
        elif view.status_key(status) != last_key[0]:
            last_key[0] = view.status_key(status)
            print(view.status_line(job, spec, status, elapsed), file=out, flush=True)

    print(
        f"refit run: {job}: {spec.policy.replicas} policy -> {spec.rollout.replicas} "
        f"rollout rank(s), {spec.transfer.refits} refit(s), bucket {spec.transfer.bucket_size}",
        file=out,
        flush=True,
    )
    try:
        result = run_job(
            manifest,
            spec,
            RunOptions(
                workdir=args.workdir,
                drain_after=args.drain_after,
                drain_pod=args.drain_pod,
                timeout=args.timeout,
            ),
            on_tick=on_tick,
            on_event=on_event,
            should_stop=lambda: stop["requested"],
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _clear(out, drawn)
    for line in view.summary(job, spec, result, time.monotonic() - started):
        print(line, file=out)
    if result.interrupted:
        print("refit run: interrupted; every worker was stopped", file=out)
        return EXIT_INTERRUPTED
    return 0 if result.succeeded else EXIT_FAILED


def _clear(out: TextIO, drawn: list[int]) -> None:
    """Erase the live block (cursor up n lines, clear to end of screen)."""
    if drawn[0]:
        out.write(f"\x1b[{drawn[0]}F\x1b[J")
        drawn[0] = 0
