"""How much memory and how many processes a local run needs, judged before anything starts.

A job sized for a cluster (``synthetic.hidden: 65536``, ``rollout.replicas: 100``) would
otherwise grow until the kernel's OOM killer picks a worker, or time out starting a
hundred processes on two cores.  The estimate is rough on purpose: what each default
worker holds (its weights, twice plus the regenerated expected copy on a rollout rank,
two transfer buffers of a whole bucket each) and a per-process floor measured on this
project's workers.

Pure: the caller reads the machine (``/proc/meminfo``, core count) and passes it in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from refit_operator.api.models import RefitJobSpec, RoleSpec

#: RSS of an idle ``refit-worker`` (torch, gloo, NIXL and UCX loaded): ~550 MiB measured
#: with `ps -o rss` during `refit run examples/local.yaml`.
WORKER_FLOOR_BYTES = 600 << 20
#: Above this share of the available memory a run is refused; above WARN_SHARE, warned.
REFUSE_SHARE = 0.9
WARN_SHARE = 0.5
#: More worker processes than this per core: start-up alone may outlast the timeouts.
PROCESSES_PER_CORE = 8
#: Receive buffers every rank allocates in ``prepare()``, a whole bucket each whatever the
#: model's size (the engine's ``NIXL_TRANSFER_BUFFER_COUNT``; a policy rank frees them once
#: it knows its role, after they were allocated).
BUFFERS_PER_RANK = 2

Verdict = Literal["ok", "warn", "refuse"]


@dataclass(frozen=True)
class Estimate:
    processes: int
    #: Bytes of the model one policy rank holds (None: unknown, e.g. a custom command).
    model_bytes: int | None
    total_bytes: int
    #: Bytes of one transfer bucket (``spec.transfer.bucketSize``).
    bucket_bytes: int = 0


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def _default_worker(role: RoleSpec) -> bool:
    return not role.command  # a custom command's memory is its own business


def estimate(spec: RefitJobSpec, model_bytes: int | None) -> Estimate:
    """Bytes the job's workers will hold at once, roughly.

    The transfer buffers count in full: every rank allocates them before it knows the
    model (``bucketSize: 10Gi`` on a 9 MiB model: 20 GiB a rank), and an allocation the
    machine cannot give fails every rank at start.
    """
    model = model_bytes or 0
    buffers = BUFFERS_PER_RANK * spec.transfer.bucket_bytes
    total = 0
    processes = 0
    for role, per_rank in (
        (spec.policy, model + buffers),
        # The served copy, the one being filled, and the expected copy the demo verifies.
        (spec.rollout, 3 * model + buffers),
    ):
        processes += role.replicas
        if _default_worker(role):
            total += role.replicas * (WORKER_FLOOR_BYTES + per_rank)
    return Estimate(processes, model_bytes, total, spec.transfer.bucket_bytes)


def judge(est: Estimate, available_bytes: int, cores: int) -> tuple[Verdict, str]:
    """Whether the machine can take the run, and the sentence that says why."""
    need = f"~{_gib(est.total_bytes)} for {est.processes} worker processes" + (
        f" (model {_gib(est.model_bytes)})" if est.model_bytes else ""
    )
    have = f"{_gib(available_bytes)} available"
    if est.total_bytes > REFUSE_SHARE * available_bytes:
        return "refuse", (
            f"this job needs {need}, more than this machine's {have}; shrink the model or the "
            f"replicas for a local run{_buckets_note(est)} (or pass --skip-resource-check to "
            "try anyway)"
        )
    if est.processes > PROCESSES_PER_CORE * max(cores, 1):
        return "refuse", (
            f"this job starts {est.processes} worker processes on {cores} cores: they would "
            "time out starting; lower the replicas for a local run (or pass "
            "--skip-resource-check to try anyway)"
        )
    if est.total_bytes > WARN_SHARE * available_bytes:
        return "warn", f"this job needs {need} of {have}; other programs may be squeezed"
    return "ok", f"needs {need} of {have}"


def _buckets_note(est: Estimate) -> str:
    """Where a bucket larger than the model is what does not fit: say so, naming the field."""
    if est.model_bytes is None or est.bucket_bytes <= est.model_bytes:
        return ""
    return (
        f", or spec.transfer.bucketSize: each rank allocates {BUFFERS_PER_RANK} buckets of"
        f" {_gib(est.bucket_bytes)} in full, more than the model"
    )
