"""What ``refit run`` shows a person: a live view on a terminal, log lines otherwise, and a
final summary.  Pure formatting of statuses and events into text; no I/O here.

Must not import: kopf, kubernetes.
"""

from __future__ import annotations

from refit_operator.local.runner import RunResult
from refit_operator.models import RefitJobSpec, RefitJobStatus
from refit_operator.reconcile import Emit


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - the loop always returns


def human_rate(bytes_per_second: float) -> str:
    """A rate in the unit that shows its digits: tiny test buckets are not '0.00 GB/s'."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_second >= scale:
            return f"{bytes_per_second / scale:.2f} {unit}"
    return f"{bytes_per_second:.0f} B/s"


def gbps(status: RefitJobStatus) -> str:
    rate = status.last_throughput_bytes_per_second
    return human_rate(rate) if rate else "-"


def fit(lines: list[str], width: int) -> list[str]:
    """Cut lines to the terminal's width: a wrapped line would not be erased on redraw."""
    limit = max(width - 1, 8)
    return [line if len(line) <= limit else line[: limit - 1] + "~" for line in lines]


def live_lines(job: str, spec: RefitJobSpec, status: RefitJobStatus, elapsed: float) -> list[str]:
    """The block a terminal redraws every tick."""
    refits = spec.transfer.refits
    return [
        f"RefitJob {job}  phase {status.phase.value}  epoch {status.epoch}  elapsed {elapsed:.1f}s",
        f"  policy   ready {status.policy.ready}/{spec.policy.replicas}",
        f"  rollout  ready {status.rollout.ready}/{spec.rollout.replicas}  "
        f"refit {min(status.refits_completed + 1, refits)}/{refits}  "
        f"done {status.refits_completed}  moved {human_bytes(status.bytes_transferred)}  "
        f"last {gbps(status)}",
        f"  restarts {status.restarts}  preemptions {status.preemptions}",
    ]


def status_key(status: RefitJobStatus) -> tuple[object, ...]:
    """What must change for the plain (non-terminal) output to print a new line."""
    return (
        status.phase,
        status.epoch,
        status.policy.ready,
        status.rollout.ready,
        status.refits_completed,
        status.restarts,
        status.preemptions,
    )


def status_line(job: str, spec: RefitJobSpec, status: RefitJobStatus, elapsed: float) -> str:
    """One grep-able line: ``key=value`` pairs."""
    return (
        f"t={elapsed:.1f}s job={job} phase={status.phase.value} epoch={status.epoch} "
        f"policy_ready={status.policy.ready}/{spec.policy.replicas} "
        f"rollout_ready={status.rollout.ready}/{spec.rollout.replicas} "
        f"refits={status.refits_completed}/{spec.transfer.refits} "
        f"bytes={status.bytes_transferred} "
        f"gbps={(status.last_throughput_bytes_per_second or 0) / 1e9:.4g} "
        f"restarts={status.restarts} preemptions={status.preemptions}"
    )


def event_line(event: Emit, elapsed: float) -> str:
    return f"t={elapsed:.1f}s event type={event.type} reason={event.reason} {event.message}"


def verification(spec: RefitJobSpec, result: RunResult) -> str:
    """What was checked before each commit, in words."""
    if not result.succeeded:
        return "incomplete (the job did not succeed)"
    if spec.weights.synthetic is not None:
        return (
            f"bit-exact: every tensor on all {spec.rollout.replicas} rollout rank(s), "
            "checked against the regenerated weights before each commit"
        )
    return "manifest complete on every rollout rank (names, shapes, dtypes) before each commit"


def summary(job: str, spec: RefitJobSpec, result: RunResult, elapsed: float) -> list[str]:
    """The final table."""
    status = result.status
    verdict = (
        "interrupted"
        if result.interrupted
        else ("timed out" if result.timed_out else status.phase.value)
    )
    lines = [f"RefitJob {job}: {verdict} in {elapsed:.1f}s"]
    if status.message:
        lines.append(f"  message: {status.message}")
    lines.append(f"  {'refit':>5}  {'epoch':>5}  {'bytes':>10}  {'seconds':>8}  {'rate':>11}")
    for rec in result.refits:
        rate = human_rate(rec.bytes / rec.seconds) if rec.seconds > 0 else "-"
        lines.append(
            f"  {rec.index:>5}  {rec.epoch:>5}  {human_bytes(rec.bytes):>10}  "
            f"{rec.seconds:>8.3f}  {rate:>11}"
        )
    lines += [
        f"  refits {status.refits_completed}/{spec.transfer.refits}  "
        f"bytes {human_bytes(status.bytes_transferred)}  restarts {status.restarts}  "
        f"preemptions {status.preemptions}"
        + (f" (drained {result.drained})" if result.drained else ""),
        f"  verification: {verification(spec, result)}",
    ]
    return lines
