"""How much memory and how many processes a local run needs, judged before anything starts.

A job sized for a cluster (``synthetic.hidden: 1000000``, ``rollout.replicas: 100``) would
otherwise grow until the kernel's OOM killer picks a worker, or time out starting a
hundred processes on two cores.  The estimate is rough on purpose: what each default
worker holds (its weights, twice plus the regenerated expected copy on a rollout rank,
two transfer buffers) and a per-process floor measured on this project's workers.

Pure: the caller reads the machine (``/proc/meminfo``, core count) and passes it in.
Must not import: kopf, kubernetes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from refit_operator.models import RefitJobSpec, RoleSpec

#: RSS of an idle ``refit-worker`` (torch, gloo, NIXL and UCX loaded): ~550 MiB measured
#: with `ps -o rss` during `refit run examples/local.yaml`.
WORKER_FLOOR_BYTES = 600 << 20
#: Above this share of the available memory a run is refused; above WARN_SHARE, warned.
REFUSE_SHARE = 0.9
WARN_SHARE = 0.5
#: More worker processes than this per core: start-up alone may outlast the timeouts.
PROCESSES_PER_CORE = 8

Verdict = Literal["ok", "warn", "refuse"]


@dataclass(frozen=True)
class Estimate:
    processes: int
    #: Bytes of the model one policy rank holds (None: unknown, e.g. a custom command).
    model_bytes: int | None
    total_bytes: int


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def _default_worker(role: RoleSpec) -> bool:
    return not role.command  # a custom command's memory is its own business


def estimate(spec: RefitJobSpec, model_bytes: int | None) -> Estimate:
    """Bytes the job's workers will hold at once, roughly.

    A transfer buffer never holds more than the whole model, so a bucket larger than the
    model costs what the model does (``bucketSize: 10Gi`` on a 9 MiB model: 9 MiB each).
    """
    model = model_bytes or 0
    bucket = min(spec.transfer.bucket_bytes, model) if model_bytes else spec.transfer.bucket_bytes
    total = 0
    processes = 0
    for role, per_rank in (
        (spec.policy, model + 2 * bucket),
        # The served copy, the one being filled, and the expected copy the demo verifies.
        (spec.rollout, 3 * model + 2 * bucket),
    ):
        processes += role.replicas
        if _default_worker(role):
            total += role.replicas * (WORKER_FLOOR_BYTES + per_rank)
    return Estimate(processes, model_bytes, total)


def judge(est: Estimate, available_bytes: int, cores: int) -> tuple[Verdict, str]:
    """Whether the machine can take the run, and the sentence that says why."""
    need = f"~{_gib(est.total_bytes)} for {est.processes} worker processes" + (
        f" (model {_gib(est.model_bytes)})" if est.model_bytes else ""
    )
    have = f"{_gib(available_bytes)} available"
    if est.total_bytes > REFUSE_SHARE * available_bytes:
        return "refuse", (
            f"this job needs {need}, more than this machine's {have}; shrink the model or the "
            "replicas for a local run (or pass --skip-resource-check to try anyway)"
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
