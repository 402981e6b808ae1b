"""``refit run``: one RefitJob on one machine, decided by the operator's own reconcile.

The loop is the operator's, minus the API server: observe (the process kubelet's pods, the
file-backed rendezvous), :func:`refit_operator.core.reconcile.reconcile`, apply the actions
(start or stop processes, patch the rendezvous files), repeat until the job's phase is
final.  Pods are rendered by the operator's renderers; the only local differences are
what one host needs (see :func:`local_env`): Service names resolve to loopback, each
role's rendezvous port is a free local port, and the rendezvous store is a directory.

Of the worker, besides ``refit_worker.contract``, it uses the file-backed rendezvous store
``refit_worker.rendezvous.file_store`` to play the job's ConfigMaps on one machine (the one
exception the import-linter contracts in ``pyproject.toml`` name).
"""

from __future__ import annotations

import asyncio
import base64
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from refit_operator.api import names
from refit_operator.api.models import Phase, RefitJobSpec, RefitJobStatus
from refit_operator.apply import fresh_key
from refit_operator.apply.applier import Applier
from refit_operator.core.coordinate import PatchData
from refit_operator.core.decision import Delete, Emit, JobView, LiftGate
from refit_operator.core.failure import Failure
from refit_operator.core.observe import Observed, observe
from refit_operator.core.reconcile import reconcile
from refit_operator.core.refusal import failed_status
from refit_operator.core.writes import WriteError
from refit_operator.local import fault_actions, metrics_ports
from refit_operator.local import faults as fault_plan
from refit_operator.local.faults import Fault, Fired
from refit_operator.local.kubelet import KubeletError, ProcessKubelet
from refit_operator.local.ledger import RefitLedger
from refit_operator.local.workdir import create_own
from refit_operator.render.pods import WEIGHTS_DIR, JobRef, RenderOptions
from refit_worker.contract.config import RendezvousConfig, SafetensorsWeights, WorkerConfig
from refit_worker.contract.env import METRICS_PORT_ENV
from refit_worker.contract.rendezvous import Layout
from refit_worker.rendezvous.file_store import FileStore

#: How often the loop observes and reconciles.
TICK_S = 0.2
#: How often the loop looks while ``--drain-at-refit`` waits for its refit.
DRAIN_TICK_S = 0.05
#: Lines of a failed pod's log that the summary shows.
FAILED_LOG_LINES = 12

FINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})


@dataclass(frozen=True)
class RunOptions:
    workdir: Path | None = None
    #: Seconds after the gang first runs at which one pod is drained (None: no drain).
    drain_after: float | None = None
    #: Drain one pod once the job has committed this many refits (None: no drain).
    drain_at_refit: int | None = None
    drain_pod: str | None = None
    #: Give up (and stop everything) after this many seconds.
    timeout: float = 3600.0
    #: PersistentVolumeClaim name -> local directory (a safetensors job's weights).
    claims: Mapping[str, Path] = field(default_factory=dict)
    #: Seconds between two rounds of observe and reconcile (tests that time faults
    #: against fast refits look more often).
    tick_s: float = TICK_S
    #: (role, rank) -> the local port its metrics serve on (see metrics_ports.py).
    metrics_ports: Mapping[tuple[str, int], int] = field(default_factory=dict)
    #: Kills and scales to do once their refit is committed (see faults.py).
    faults: tuple[Fault, ...] = ()


@dataclass
class RunResult:
    status: RefitJobStatus
    #: The job as the last round saw it (its uid, generation and spec: a scale changes
    #: them); None before the first round.
    job: JobView | None = None
    #: Every refit the rollout ranks reported, itemised where they did (see ledger.py).
    ledger: RefitLedger = field(default_factory=RefitLedger)
    #: Pod name -> the last lines of its log, for each pod that failed (kept past clean-up).
    failed_logs: dict[str, str] = field(default_factory=dict)
    events: list[Emit] = field(default_factory=list)
    drained: str | None = None
    #: The faults done, in order, with what followed each.
    fired: list[Fired] = field(default_factory=list)
    #: role -> uid -> seconds into the run when a pod of that uid was first seen.
    first_seen: dict[str, dict[str, float]] = field(default_factory=dict)
    interrupted: bool = False
    timed_out: bool = False

    @property
    def succeeded(self) -> bool:
        return self.status.phase == Phase.SUCCEEDED and not self.interrupted


class LocalCluster:
    """The few objects a job owns, held in memory; pods live in the process kubelet."""

    def __init__(
        self,
        job: JobRef,
        spec: RefitJobSpec,
        workdir: Path,
        claims: Mapping[str, Path] | None = None,
    ) -> None:
        self.job, self.spec = job, spec
        self.workdir = workdir
        source = spec.weights.safetensors
        #: Where the weights volume's files are on this machine (a safetensors job).
        self.weights_dir = (claims or {}).get(source.claim_name) if source else None
        policy, rollout = spec.policy.replicas, spec.rollout.replicas
        self.layout = Layout(policy, rollout, names.rendezvous_shards(policy, rollout))
        self.store_dir = workdir / "rendezvous"
        self.store = FileStore(self.store_dir, self.layout)
        # Workers die with `refit run` even when it is killed with SIGKILL.
        self.kubelet = ProcessKubelet(
            workdir,
            rewrite_env=self._local_env,
            env_source=self._secret_value,
            die_with_parent=True,
            claims=claims,
        )
        self.others: dict[tuple[str, str], dict[str, Any]] = {}
        self._ports = LoopbackPorts()
        #: The job's status as the last round wrote it, and where its Events go.
        self.status = RefitJobStatus()
        self.on_event: Callable[[Emit], None] = lambda e: None
        #: One host: each rank serves its metrics on a port of its own.
        self.metrics_ports: Mapping[tuple[str, int], int] = {}

    def _local_env(self, pod: Mapping[str, Any], env: dict[str, str]) -> dict[str, str]:
        rewritten = local_env(
            env,
            port=self._ports.for_pod(pod),
            store_dir=self.store_dir,
            shards=self.layout.shards,
            weights_dir=self.weights_dir,
        )
        metrics = metrics_ports.port_of(self.metrics_ports, pod)
        if METRICS_PORT_ENV in rewritten and metrics is not None:
            rewritten[METRICS_PORT_ENV] = str(metrics)
        return rewritten

    def _secret_value(self, pod: Mapping[str, Any], source: Mapping[str, Any]) -> str:
        """A ``secretKeyRef`` (the job's signing key), read from the Secrets held here."""
        ref = source.get("secretKeyRef") or {}
        secret = self.others.get(("Secret", str(ref.get("name"))))
        data = (secret or {}).get("data") or {}
        if ref.get("key") not in data:
            raise KubeletError(
                f"pod {pod['metadata']['name']}: no key {ref.get('key')!r} in Secret "
                f"{ref.get('name')!r} of this run (sources other than the job's own Secrets "
                "are not available to `refit run`)"
            )
        return base64.b64decode(str(data[ref["key"]])).decode()

    def observed_rendezvous(self) -> dict[str, dict[str, str]]:
        base = names.rendezvous_name(self.job.name)
        return {
            self.layout.name(base, shard): self.store.read_shard(shard)
            for shard in range(self.layout.shards)
        }

    # -- the applier's Writes (``refit_operator.apply.applier``) ------------------------------

    async def create(self, obj: dict[str, Any]) -> WriteError | None:
        if obj.get("kind") == "Pod":
            self.kubelet.create(obj)  # raises KubeletError: the run cannot go on
        else:
            obj = fresh_key.with_fresh_key(obj)  # `refit run` makes its own key
            self.others[(str(obj["kind"]), str(obj["metadata"]["name"]))] = obj
            if (event := fresh_key.created_event(obj)) is not None:
                self.on_event(event)
        return None

    async def delete(self, action: Delete) -> WriteError | None:
        if action.kind == "Pod":
            # One host, always ready: no pod is ever on a lost node, so a force delete
            # (grace 0) is never asked for here; it would stop the process group at once.
            grace = None if action.grace_period_seconds is None else 0.0
            self.kubelet.delete(action.name, grace_seconds=grace)
        else:
            self.others.pop((action.kind, action.name), None)
        return None

    async def lift_gate(self, action: LiftGate) -> WriteError | None:
        # One machine, no scheduler: a pod runs from creation; the gate only leaves its
        # manifest, as it would leave the API's.
        self.kubelet.set_scheduling_gates(action.name, action.gates)
        return None

    async def patch_data(self, action: PatchData) -> None:
        self.store.patch_shard(self._shard_of(action.name), action.data)

    async def delete_job(self) -> None:
        """The run ends with the job's final phase: there is nothing to delete."""

    async def emit(self, event: Emit) -> None:
        self.on_event(event)

    async def write_status(self, status: RefitJobStatus) -> None:
        self.status = status

    def _shard_of(self, configmap: str) -> int:
        base = names.rendezvous_name(self.job.name)
        for shard in range(self.layout.shards):
            if self.layout.name(base, shard) == configmap:
                return shard
        raise ValueError(f"{configmap} is not a rendezvous ConfigMap of job {self.job.name}")

    def close(self, timeout: float) -> None:
        self.kubelet.close(timeout)
        self.store.close()


def local_env(
    env: Mapping[str, str],
    *,
    port: int,
    store_dir: Path | None = None,
    shards: int = 1,
    weights_dir: Path | None = None,
) -> dict[str, str]:
    """What one host changes in a rendered pod's env: the role's rendezvous on loopback at
    ``port``; with ``store_dir``, the file-backed store instead of the ConfigMaps; with
    ``weights_dir``, the weights volume's mount path replaced by that directory."""
    config = WorkerConfig.from_env(env)
    update: dict[str, Any] = {"master_addr": "127.0.0.1", "master_port": port}
    if store_dir is not None:
        update["rendezvous"] = RendezvousConfig(
            store="file", location=str(store_dir), shards=shards
        )
    weights = config.weights
    if weights_dir is not None and isinstance(weights, SafetensorsWeights):
        inside = weights.path.removeprefix(WEIGHTS_DIR).lstrip("/")
        update["weights"] = weights.model_copy(update={"path": str(weights_dir / inside)})
    return {**env, **config.model_copy(update=update).to_env()}


class LoopbackPorts:
    """One free local port per (role, epoch): each role's torch.distributed rendezvous."""

    def __init__(self) -> None:
        self._ports: dict[tuple[str, str], int] = {}

    def for_pod(self, pod: Mapping[str, Any]) -> int:
        labels = pod["metadata"].get("labels") or {}
        key = (str(labels.get(names.LABEL_ROLE, "")), str(labels.get(names.LABEL_EPOCH, "")))
        if key not in self._ports:
            self._ports[key] = _free_port()
        return self._ports[key]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(
    manifest: Mapping[str, Any],
    spec: RefitJobSpec,
    options: RunOptions,
    *,
    on_tick: Callable[[RefitJobStatus, LocalCluster], None] = lambda s, c: None,
    on_event: Callable[[Emit], None] = lambda e: None,
    should_stop: Callable[[], bool] = lambda: False,
) -> RunResult:
    """Run the job until its phase is final, ``should_stop()`` or the timeout; always
    stops every process and removes its working files before returning."""
    meta = manifest.get("metadata") or {}
    job = JobRef(str(meta["name"]), str(meta.get("namespace") or "default"), str(uuid.uuid4()))
    own_dir = options.workdir is None
    # Absolute: every pod runs in a directory of its own, so a relative path would miss.
    workdir = create_own(job.name) if options.workdir is None else options.workdir.resolve()
    cluster = LocalCluster(job, _sized(spec, options), workdir, options.claims)
    applier = Applier(cluster, clock=lambda: datetime.now(UTC))
    cluster.metrics_ports = options.metrics_ports
    view = JobView(job, int(meta.get("generation") or 1), manifest["spec"], RefitJobStatus())
    result = RunResult(view.status)
    started = time.monotonic()
    running_since: float | None = None

    def emit(event: Emit) -> None:
        result.events.append(event)
        on_event(event)

    cluster.on_event = emit
    try:
        while True:
            status = _round(cluster, applier, view, result)
            if status is None:
                return result  # a pod could not start
            view = JobView(view.ref, view.generation, view.raw_spec, status)
            on_tick(status, cluster)
            if status.phase in FINAL_PHASES:
                return result
            if running_since is None and status.phase == Phase.RUNNING:
                running_since = time.monotonic()
            _drain_when_due(
                options, result, cluster, running_since=running_since, on_event=on_event
            )
            view = fault_actions.round_(options, result, cluster, view, time.monotonic() - started)
            if should_stop():
                result.interrupted = True
                return result
            if time.monotonic() - started > options.timeout:
                result.timed_out = True
                return result
            time.sleep(_tick(options, result))
    finally:
        cluster.close(timeout=float(spec.preemption.grace_period_seconds) + 5)
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def _sized(spec: RefitJobSpec, options: RunOptions) -> RefitJobSpec:
    """The spec with as many rollout replicas as the run will have: a scale-up's ranks
    need room in the rendezvous from the start."""
    most = fault_plan.most_rollout_replicas(options.faults, spec)
    return spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"replicas": most})})


def _tick(options: RunOptions, result: RunResult) -> float:
    """A drain or fault waiting for its refit looks more often, so it lands inside the job;
    so does a kill whose replacement's first commit is being timed."""
    drain = options.drain_at_refit is not None and result.drained is None
    pending = drain or fault_actions.pending(options, result)
    return min(options.tick_s, DRAIN_TICK_S) if pending else options.tick_s


def _round(
    cluster: LocalCluster, applier: Applier, view: JobView, result: RunResult
) -> RefitJobStatus | None:
    """Observe, reconcile, apply: the job's status after the round (kept in ``result``),
    or None when a pod could not start (the job then failed)."""
    result.job = view
    observed = observe(
        cluster.kubelet.pods(), list(cluster.others.values()), cluster.observed_rendezvous()
    )
    # Before the decision is applied (a new epoch clears what the old one reported), and
    # the very entries the reconcile counts: the rows add up to the status's bytes.
    result.ledger.ingest_entries(observed.entries.progress())
    _keep_failed_logs(result, cluster, observed)
    decision = reconcile(view, observed, datetime.now(UTC), RenderOptions())
    try:
        decision = asyncio.run(applier.apply(view, observed, decision))
    except KubeletError as exc:
        # As a pod whose container cannot start: nothing a restart would fix here.
        failure = Failure("StartError", f"a pod could not start: {exc}")
        now = datetime.now(UTC)
        result.status = failed_status(decision.status, failure, generation=view.generation, now=now)
        cluster.on_event(Emit("Warning", "StartError", result.status.message))
        return None
    result.status = decision.status
    return decision.status


def _drain_when_due(
    options: RunOptions,
    result: RunResult,
    cluster: LocalCluster,
    *,
    running_since: float | None,
    on_event: Callable[[Emit], None],
) -> None:
    """``--drain-after`` / ``--drain-at-refit``: drain one pod once it is due (once per run)."""
    if result.drained is not None or not _drain_due(options, result.ledger, running_since):
        return
    target = _live_pod(cluster, options.drain_pod or f"{cluster.job.name}-rollout-0")
    if target is not None and cluster.kubelet.disrupt(target):
        result.drained = target
        on_event(
            Emit(
                "Warning",
                "Drain",
                f"draining {target}: DisruptionTarget (EvictionByEvictionAPI), then deletion",
            )
        )


def _live_pod(cluster: LocalCluster, rank: str) -> str | None:
    """The pod that runs ``rank`` (``<job>-<role>-<rank>``, or a pod name of it) now."""
    wanted = re.sub(r"-[eg][0-9]+$", "", rank)
    for pod in cluster.kubelet.pods():
        meta = pod["metadata"]
        labels = meta.get("labels") or {}
        mine = f"{cluster.job.name}-{labels.get(names.LABEL_ROLE)}-{labels.get(names.LABEL_RANK)}"
        if mine == wanted and "deletionTimestamp" not in meta:
            return str(meta["name"])
    return None


def _drain_due(options: RunOptions, ledger: RefitLedger, running_since: float | None) -> bool:
    """Whether the simulated drain is due: a rollout rank committed N refits, or S seconds
    of running.  The first rank's report, not the job's count: a small model's refits take
    a fraction of a second, and the drain must land while the job still has refits left."""
    if options.drain_at_refit is not None:
        return ledger.most_committed() >= options.drain_at_refit
    return (
        options.drain_after is not None
        and running_since is not None
        and time.monotonic() - running_since >= options.drain_after
    )


def _keep_failed_logs(result: RunResult, cluster: LocalCluster, observed: Observed) -> None:
    """The tail of each failed pod's log, read before the run's files go."""
    for pod in observed.pods:
        if pod.failure and pod.name not in result.failed_logs:
            result.failed_logs[pod.name] = cluster.kubelet.log_tail(pod.name, FAILED_LOG_LINES)
