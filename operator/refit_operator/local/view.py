"""What ``refit run`` shows a person: a live view on a terminal, log lines otherwise, and a
final summary.  Pure formatting of statuses and events into text; no I/O here.
"""

from __future__ import annotations

from refit_operator.api.models import Phase, RefitJobSpec, RefitJobStatus
from refit_operator.api.status import RolloutReplica, first_refit_source, seed_words, version_words
from refit_operator.core.decision import Emit
from refit_operator.local.faults import Fault, outcome
from refit_operator.local.runner import RunResult


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


def connection(status: RefitJobStatus) -> str:
    """Whether the current epoch's ranks are connected (its barrier is open), or how far
    along.  A Connected condition left from an earlier epoch says nothing of this one."""
    cond = next((c for c in status.conditions if c.type == "Connected"), None)
    if cond is None or status.phase is not Phase.RUNNING:
        return "-"
    since = status.epoch_start_time
    if cond.status == "True" and (since is None or cond.last_transition_time >= since):
        return "connected"
    return f"connecting ({cond.message})" if cond.status != "True" else "connecting"


def live_lines(job: str, spec: RefitJobSpec, status: RefitJobStatus, elapsed: float) -> list[str]:
    """The block a terminal redraws every tick.  ``moved``: the status's bytes, the one
    figure the summary's rows and total also show."""
    refits = spec.transfer.refits
    return [
        f"RefitJob {job}  phase {status.phase.value}  epoch {status.epoch}  elapsed {elapsed:.1f}s",
        f"  policy   ready {status.policy.ready}/{spec.policy.replicas}",
        f"  rollout  ready {status.rollout.ready}/{rollout_desired(spec, status)}  "
        f"refit {min(status.refits_completed + 1, refits)}/{refits}  "
        f"committed {status.refits_completed}  moved {human_bytes(status.bytes_transferred)}  "
        f"last {gbps(status)}",
        f"  restarts {status.restarts}  preemptions {status.preemptions}  "
        f"replacements {replacements(status)}  ranks {connection(status)}",
        *replica_lines(status),
    ]


def rollout_desired(spec: RefitJobSpec, status: RefitJobStatus) -> int:
    """The rollout replicas asked for now: the status's (a scale changes it mid-run) once
    the operator reports it, the manifest's before."""
    return status.rollout.desired or spec.rollout.replicas


def replacements(status: RefitJobStatus) -> int:
    """Rollout replicas replaced alone so far."""
    return status.rollout.replacements


def _replicas(status: RefitJobStatus) -> list[RolloutReplica]:
    """The status's rollout replicas in rank order."""
    return sorted(status.rollout_replicas, key=lambda r: r.rank)


def replica_lines(status: RefitJobStatus) -> list[str]:
    """One line per rollout replica, from ``status.rolloutReplicas`` (none until the
    operator reports them): its generation (replacements of that rank), the refits it has
    committed (``lastCommittedRefit``: the job's count up to its last one), its pod, and
    once the pod committed, who seeded it and how soon it served."""
    out = []
    for replica in _replicas(status):
        seeded = ""
        if replica.seeded_from is not None:
            seeded = (
                f"  {first_refit_source(replica.seeded_from)}, serving "
                f"{replica.seconds_to_serving or 0.0:.1f} s after its start"
            )
        out.append(
            f"    rollout-{replica.rank}  generation {replica.generation}  "
            f"{'ready' if replica.ready else 'not ready'}  committed "
            f"{replica.last_committed_refit}  pod {replica.pod or '-'}{seeded}"
        )
    return out


def seed_lines(status: RefitJobStatus) -> list[str]:
    """``rollout-1 seeded from rollout-0: refit 3, 1.2 MB in 0.050 s, serving 2.3 s after
    its start``: how each replica's current pod came to serve (those that did)."""
    out = []
    for replica in _replicas(status):
        words = seed_words(replica)
        if words is not None:
            out.append(f"rollout-{replica.rank} {words}")
    return out


def fault_lines(planned: tuple[Fault, ...], result: RunResult) -> list[str]:
    """The summary's lines about ``--kill-*`` / ``--scale-*``: what each did and what
    followed, or why it never fired."""
    lines = []
    for fired in result.fired:
        # The same role that outcome() names, so a scale's new rollout pods are not
        # counted as new policy pods.
        seen = result.first_seen.get(fired.fault.untouched_role, {})
        new = frozenset(uid for uid, at in seen.items() if at > fired.at)
        lines.append(outcome(fired, new))
    done = {f.fault for f in result.fired}
    for fault in planned:
        if fault not in done and not result.interrupted:
            lines.append(
                f"  note: {fault.flag} {fault.at_refit} did not fire: the job ended before "
                f"{fault.at_refit} refit(s) were committed"
            )
    return lines


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
        connection(status) == "connected",
        rollout_desired_key(status),
        replacements(status),
        tuple((r.rank, r.generation, r.ready, r.seeded_from) for r in _replicas(status)),
    )


def rollout_desired_key(status: RefitJobStatus) -> int:
    return status.rollout.desired


def status_line(job: str, spec: RefitJobSpec, status: RefitJobStatus, elapsed: float) -> str:
    """One grep-able line: ``key=value`` pairs.  ``refits`` counts what every rollout rank
    committed, ``bytes`` what the rollout pods reported receiving (the status's, as the
    summary's rows and total), ``connected`` the current epoch's ranks."""
    return (
        f"t={elapsed:.1f}s job={job} phase={status.phase.value} epoch={status.epoch} "
        f"policy_ready={status.policy.ready}/{spec.policy.replicas} "
        f"rollout_ready={status.rollout.ready}/{rollout_desired(spec, status)} "
        f"refits={status.refits_completed}/{spec.transfer.refits} "
        f"bytes={status.bytes_transferred} "
        f"gbps={(status.last_throughput_bytes_per_second or 0) / 1e9:.4g} "
        f"restarts={status.restarts} preemptions={status.preemptions} "
        f"replacements={status.rollout.replacements} "
        f"connected={'yes' if connection(status) == 'connected' else 'no'}"
        + "".join(f" gen{r.rank}={r.generation}" for r in _replicas(status))
        + "".join(f" seed{r.rank}={r.seeded_from}" for r in _replicas(status) if r.seeded_from)
    )


def event_line(event: Emit, elapsed: float) -> str:
    return f"t={elapsed:.1f}s event type={event.type} reason={event.reason} {event.message}"


#: What each reported verification method means, in the summary's words.
_VERIFIED = {
    "bit-exact": "bit-exact: every tensor checked against independently regenerated weights",
    "tokens": "tokens: the engine's greedy tokens for fixed prompts equal the trainer's for"
    " the same weights",
    "served-params": "served-params: every layer vLLM serves, read back through its own"
    " kernels after the landing, computes with the sent tensors",
    "checksums": "checksums: every tensor's integrity hash matched the sender's",
    "manifest": "manifest only: every name, shape, dtype and byte accounted for, values unchecked",
    "none": "none reported: no rollout rank said it checked what it committed",
}


def verification(status: RefitJobStatus) -> str:
    """How the committed refits were checked, as the rollout ranks reported it (the weakest
    method any rank applied), never what the spec suggests."""
    if status.refits_completed == 0:
        return "nothing committed, nothing verified"
    return _VERIFIED.get(status.verification, status.verification)


def _verdict(spec: RefitJobSpec, result: RunResult) -> str:
    status = result.status
    if result.interrupted:
        want = spec.transfer.refits
        if status.refits_completed >= want and status.phase is not Phase.FAILED:
            # Stopped in the moment between the last commit and the phase: the work is done.
            return (
                f"interrupted after all {want} refit(s) committed, before the job was "
                "marked Succeeded"
            )
        return "interrupted"
    return "timed out" if result.timed_out else status.phase.value


def summary(job: str, spec: RefitJobSpec, result: RunResult, elapsed: float) -> list[str]:
    """The final table: one row per refit the rollout pods reported; rows add up to the
    bytes line below them, the status's ``bytesTransferred``."""
    status = result.status
    lines = [f"RefitJob {job}: {_verdict(spec, result)} in {elapsed:.1f}s"]
    if status.message:
        lines.append(f"  message: {status.message}")
    rows = result.ledger.rows()
    if rows:
        lines += [
            f"  {'refit':>5}  {'epoch':>5}  {'bytes':>10}  {'seconds':>8}  {'rate':>11}  "
            f"{'pods':>4}",
            "  (bytes: what the rollout pods received for the refit together, each pod "
            "counted once; seconds: transfer and commit of the slowest one; rate: those "
            "bytes over those seconds, the gang's aggregate; pods: how many pods' bytes)",
        ]
    for row in rows:
        rate = human_rate(row.bytes / row.seconds) if row.seconds > 0 else "-"
        lines.append(
            f"  {row.label:>5}  {row.epoch:>5}  {human_bytes(row.bytes):>10}  "
            f"{row.seconds:>8.3f}  {rate:>11}  {row.pods:>4}"
        )
    if any(not row.itemised for row in rows):
        lines.append(
            "  * not itemised: refits that finished between two reads of the reports, or "
            "that only some rollout ranks committed before a preemption (the next epoch "
            "moved them again)"
        )
    lines += [
        f"  refits {status.refits_completed}/{spec.transfer.refits}  "
        f"bytes {human_bytes(status.bytes_transferred)}  restarts {status.restarts}  "
        f"preemptions {status.preemptions}  rollout replacements {status.rollout.replacements}"
        + (f" (drained {result.drained})" if result.drained else ""),
        f"  verification: {verification(status)}",
        *(f"  {line}" for line in seed_lines(status)),
        *(f"  serving: {line}" for line in version_words(status.versions)),
    ]
    for pod, tail in result.failed_logs.items():
        lines.append(f"  last lines of {pod}'s log:")
        lines += [f"    | {line}" for line in (tail.splitlines() or ["(empty)"])]
    return lines
