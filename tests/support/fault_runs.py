"""Fault scenarios on the local runner: drains at chosen stages of a refit, SIGKILLs of one
rank, with figures.  Shared by ``tests/reliability`` and ``bench/reliability_report.py``.

Everything is real: ``refit_operator.local.runner.run_job`` (the operator's own reconcile)
drives ``refit-worker`` processes through the process kubelet, over real NIXL, gloo and the
file-backed rendezvous; a drain is the kubelet's DisruptionTarget + deletion (preStop, then
the stop signal), a kill is ``os.kill(pid, SIGKILL)``.

A stage is reached by watching the rendezvous between reconcile ticks (what was published,
whether the barrier is open, what the rollout ranks committed); where that cannot pin the
moment (inside a bucket, right at a refit boundary) the ranks' own ``preempted`` reports
say where each rank really stopped, and :func:`stop_point` classifies them.

Must not import: kopf, kubernetes (no API server here).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from refit_operator import names
from refit_operator.core.coordinate import merged
from refit_operator.local.runner import LocalCluster, RunOptions, RunResult, run_job
from refit_operator.models import RefitJobSpec, RefitJobStatus, parse_spec
from refit_worker.contract.rendezvous import EntryError, Snapshot, read_snapshot


@dataclass(frozen=True)
class Topology:
    policy: int
    rollout: int

    def __str__(self) -> str:
        return f"({self.policy},{self.rollout})"


TOPOLOGIES = (Topology(1, 1), Topology(2, 2), Topology(1, 3))


class Stage(StrEnum):
    BEFORE_BARRIER = "before the barrier"
    METADATA = "during metadata exchange"
    MID_BUCKET = "mid-bucket"
    BETWEEN_REFITS = "between refits"
    FINAL_COMMIT = "during the final commit"


#: Longest a rank is held back to catch the metadata exchange half-done.
HOLD_LIMIT_S = 30.0

#: The order one job meets the stages in: one drain per epoch, the job resumes each time.
STAGES = tuple(Stage)


def manifest(
    name: str,
    topo: Topology,
    *,
    refits: int,
    layers: int = 4,
    hidden: int = 256,
    vocab: int = 4096,
    bucket: str = "64Ki",
    max_restarts: int = 0,
    backoff: float = 0.5,
    grace: int = 20,
    timeout: int = 30,
) -> dict[str, Any]:
    """A RefitJob small enough for CI: a ~9 MiB bf16 model in 64 KiB buckets, so that a
    refit has ~150 bucket boundaries for a drain to land between."""
    return {
        "apiVersion": "refit.dev/v1alpha1",
        "kind": "RefitJob",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "image": "kube-refit:test",
            "policy": {"replicas": topo.policy},
            "rollout": {"replicas": topo.rollout},
            "weights": {
                "synthetic": {
                    "layers": layers,
                    "hidden": hidden,
                    "vocab": vocab,
                    "dtype": "bfloat16",
                    "seed": 7,
                }
            },
            "transfer": {"bucketSize": bucket, "refits": refits, "timeoutSeconds": timeout},
            "preemption": {"signal": "SIGTERM", "gracePeriodSeconds": grace},
            "failurePolicy": {
                "maxRestarts": max_restarts,
                "backoffSeconds": backoff,
                "maxBackoffSeconds": backoff * 4,
            },
        },
    }


# -- what the ranks report -------------------------------------------------------------


class StopPoint(StrEnum):
    CONNECT = "before connecting (barrier wait)"
    BUCKET = "at a bucket boundary inside a refit"
    BOUNDARY = "at a refit boundary"
    PEER = "after a peer left (its transfer or collective broke)"
    DONE = "finished (the drain came too late to matter)"
    OTHER = "elsewhere"


def stop_point(message: str, state: str) -> StopPoint:
    """Where a rank stopped, from its last progress report (pure)."""
    if state == "done":
        return StopPoint.DONE
    if message.startswith("after "):
        return StopPoint.PEER
    if "bucket boundary" in message:
        return StopPoint.BUCKET
    if (
        message.startswith("signal received by")
        or "posted a preemption notice" in message
        or "a peer left" in message
    ):
        return StopPoint.BOUNDARY
    if "preempt" in message.lower():
        return StopPoint.CONNECT  # the barrier wait raised Preempted
    return StopPoint.OTHER


_COMMITTED = re.compile(r"rollout rank \d+: refit (\d+) committed")


def committed_refits(log_text: str) -> list[int]:
    """Refit ids a rollout rank's log says it committed, in order (pure)."""
    return [int(m.group(1)) for m in _COMMITTED.finditer(log_text)]


# -- watching a run --------------------------------------------------------------------


@dataclass
class EpochView:
    """One tick's view of the current epoch: pods, rendezvous, processes."""

    epoch: int
    snap: Snapshot | None
    #: (pod name, uid) of this epoch's pods.
    pods: list[tuple[str, str]]
    pids: dict[str, int]
    refits: int

    @property
    def published(self) -> int:
        return len(self.snap.meta) if self.snap else 0

    @property
    def barrier_open(self) -> bool:
        return bool(self.snap and self.snap.barrier)

    def committed(self) -> int:
        """The most refits any rollout rank of this epoch reported committed."""
        if self.snap is None:
            return 0
        return max(
            (
                p.refits_completed
                for (role, _), p in self.snap.progress.items()
                if role == "rollout"
            ),
            default=0,
        )

    def last_refit_seconds(self) -> float:
        if self.snap is None:
            return 0.0
        return max(
            (p.last_refit.seconds for p in self.snap.progress.values() if p.last_refit),
            default=0.0,
        )


def view_of(status: RefitJobStatus, cluster: LocalCluster) -> EpochView:
    epoch = status.epoch
    # The epoch's policy pods, and the rollout pods serving it (created in any epoch).
    pods = [
        p
        for p in cluster.kubelet.pods()
        if (p["metadata"].get("labels") or {}).get(names.LABEL_EPOCH) == str(epoch)
        or (
            (p["metadata"].get("labels") or {}).get(names.LABEL_ROLE) == "rollout"
            and "deletionTimestamp" not in p["metadata"]
        )
    ]
    try:
        snap: Snapshot | None = read_snapshot(
            merged(cluster.observed_rendezvous()),
            epoch,
            cluster.layout.policy_world_size,
            cluster.layout.rollout_world_size,
        )
    except EntryError:
        snap = None
    return EpochView(
        epoch,
        snap,
        [(p["metadata"]["name"], p["metadata"]["uid"]) for p in pods],
        cluster.kubelet.pids(),
        status.refits_completed,
    )


@dataclass
class Fault:
    """One injected fault and what followed it."""

    kind: str  # "drain" or "kill"
    epoch: int
    target: str
    stage: str
    #: What the tick saw when the fault went in.
    published: int
    barrier_open: bool
    committed: int
    at: float
    old_pods: list[tuple[str, str]]
    #: Seconds until every pod of the epoch had exited (None: not seen).
    stopped_s: float | None = None
    #: Seconds until the next epoch's gang was created (None: not seen).
    restarted_s: float | None = None
    #: Seconds until the next epoch's barrier opened (None: not seen).
    recovered_s: float | None = None


#: (kind "drain" or "kill", pod name, what the plan calls the moment)
Choice = tuple[str, str, str]


class Plan:
    """When to inject what; :meth:`decide` is asked once per tick until it answers."""

    def decide(self, view: EpochView) -> Choice | None:
        raise NotImplementedError

    def after(self, view: EpochView) -> None:
        """Called right after a fault went in (e.g. to let a held rank go)."""


@dataclass
class Observer:
    """Asks ``plan`` each tick; a returned choice injects a fault and records what followed."""

    plan: Plan
    faults: list[Fault] = field(default_factory=list)
    max_faults: int = 1
    #: (pod name, uid) -> exit code, as the run's kubelet recorded them.
    exit_codes: dict[tuple[str, str], int] = field(default_factory=dict)

    def __call__(self, status: RefitJobStatus, cluster: LocalCluster) -> None:
        self.exit_codes = cluster.kubelet.exit_codes  # the live dict, kept after the run
        view = view_of(status, cluster)
        now = time.monotonic()
        for fault in self.faults:
            if fault.stopped_s is None and all(
                key in cluster.kubelet.exit_codes for key in fault.old_pods
            ):
                fault.stopped_s = now - fault.at
            later = view.epoch > fault.epoch and status.created_epoch == view.epoch
            if fault.restarted_s is None and later:
                fault.restarted_s = now - fault.at
            if fault.recovered_s is None and later and view.barrier_open:
                fault.recovered_s = now - fault.at
        done = {f.epoch for f in self.faults}
        if len(self.faults) >= self.max_faults or view.epoch in done or not view.pods:
            return
        if status.created_epoch != view.epoch:
            return
        choice = self.plan.decide(view)
        if choice is None:
            return
        kind, rank, stage = choice
        target = live_pod(view, rank)
        fault = Fault(
            kind,
            view.epoch,
            target,
            stage,
            view.published,
            view.barrier_open,
            view.committed(),
            now,
            list(view.pods),
        )
        if kind == "drain":
            if not cluster.kubelet.disrupt(target):
                return
        else:
            pid = view.pids.get(target)
            if pid is None:
                return
            os.kill(pid, signal.SIGKILL)
        self.faults.append(fault)
        self.plan.after(view)


# -- drains at stages ------------------------------------------------------------------


@dataclass
class StagePlan(Plan):
    """Decides, per epoch, when the drain for that epoch's stage goes in.

    For the metadata exchange policy rank 0 is held (SIGSTOP) before it can publish, so
    the exchange is caught half-done every time; it is let go (SIGCONT) right after the
    drain, or after ``HOLD_LIMIT_S`` whatever happens.
    """

    stages: tuple[Stage, ...]
    refits: int
    #: The rollout pod to drain.
    target: str
    rollout_ranks: int
    #: The pod held back for the metadata stage.
    held_pod: str
    _first_commit: dict[int, tuple[int, float]] = field(default_factory=dict)
    #: Refits committed before each epoch began (where its gang resumed).
    _base: dict[int, int] = field(default_factory=dict)

    _held: dict[int, tuple[int, float]] = field(default_factory=dict)
    #: The last refit's duration any rank reported.
    _refit_s: float = 0.0

    def decide(self, view: EpochView) -> Choice | None:
        if view.epoch >= len(self.stages):
            return None
        stage = self.stages[view.epoch]
        base = self._base.setdefault(view.epoch, view.refits)
        if stage is Stage.BEFORE_BARRIER:
            hit = view.published == 0 and not view.barrier_open
        elif stage is Stage.METADATA:
            hit = self._half_published(view)
        elif stage is Stage.BETWEEN_REFITS:
            # Right as a rollout rank reports a commit: the next refit is only starting.
            hit = view.committed() > base
        else:
            hit = self._inside_refit(view, base, final=stage is Stage.FINAL_COMMIT)
        return ("drain", self.target, stage.value) if hit else None

    def _half_published(self, view: EpochView) -> bool:
        """Hold policy rank 0: no policy rank can publish (they join their gloo group
        first), so the exchange stops once every rollout rank published."""
        if view.epoch not in self._held:
            held = view.pids.get(self.held_pod)
            if held is None or view.published > 0:
                return False
            os.kill(held, signal.SIGSTOP)
            self._held[view.epoch] = (held, time.monotonic())
        _, since = self._held[view.epoch]
        if time.monotonic() - since > HOLD_LIMIT_S:
            self.after(view)
            return False
        return view.published == self.rollout_ranks and not view.barrier_open

    def after(self, view: EpochView) -> None:
        held = self._held.get(view.epoch)
        if held is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(held[0], signal.SIGCONT)

    def _inside_refit(self, view: EpochView, base: int, *, final: bool) -> bool:
        """Half a refit after a commit (or after the barrier opened, for a gang that
        resumes at the last refit), so the drain lands inside the next transfer."""
        if view.last_refit_seconds() > 0:
            self._refit_s = view.last_refit_seconds()
        committed = view.committed()
        ready = committed >= self.refits - 1 if final else committed > base
        if not (ready and view.barrier_open):
            return False
        seen = self._first_commit.setdefault(view.epoch, (committed, time.monotonic()))
        # The final refit is the last chance: aim earlier into it, so a fast refit does
        # not finish before the drain goes in.
        return time.monotonic() - seen[1] >= (0.25 if final else 0.5) * self._refit_s


@dataclass
class KillPlan(Plan):
    """Epoch i: SIGKILL pod ``kills[i].pod``, ``kills[i].delay`` s after its gang was
    created (anchor "created") or after its barrier opened (anchor "barrier")."""

    kills: list[Kill]
    _since: dict[int, float] = field(default_factory=dict)

    def decide(self, view: EpochView) -> Choice | None:
        if view.epoch >= len(self.kills):
            return None
        kill = self.kills[view.epoch]
        if kill.anchor == "barrier" and not view.barrier_open:
            return None
        since = self._since.setdefault(view.epoch, time.monotonic())
        if time.monotonic() - since < kill.delay:
            return None
        return "kill", kill.pod, phase_of(view)


def phase_of(view: EpochView) -> str:
    """Where the gang was, as the rendezvous shows it (pure)."""
    if not view.barrier_open:
        return f"before the barrier ({view.published}/{len(view.pods)} published)"
    if view.committed() == 0 and view.refits == 0:
        return "barrier open, first refit not committed yet"
    return f"refits running ({view.committed()} committed)"


def rank_name(job: str, role: str, rank: int) -> str:
    """``<job>-<role>-<rank>``: a rank, whichever pod (epoch or generation) runs it."""
    return f"{job}-{role}-{rank}"


def live_pod(view: EpochView, rank: str) -> str:
    """The pod now running ``rank`` (its name with the ``-e<epoch>``/``-g<generation>``
    suffix); ``rank`` itself when no such pod is seen (the fault then finds nothing)."""
    found = [name for name, _uid in view.pods if re.fullmatch(re.escape(rank) + r"-[eg]\d+", name)]
    return max(found, key=lambda n: int(n.rsplit("-", 1)[1][1:]), default=rank)


def stage_plan(job: str, topo: Topology, refits: int) -> StagePlan:
    """Drain the last rollout rank at each stage in turn."""
    return StagePlan(
        STAGES,
        refits,
        rank_name(job, "rollout", topo.rollout - 1),
        topo.rollout,
        rank_name(job, "policy", 0),
    )


def run_with(
    job: Mapping[str, Any], plan: Plan, workdir: Path, *, max_faults: int, timeout: float = 300.0
) -> tuple[RunResult, Observer, RefitJobSpec]:
    spec = parse_spec(job["spec"])
    observer = Observer(plan, max_faults=max_faults)
    # A refit of the test's model takes tens of milliseconds: look ten times as often as
    # refit run does, so a drain aimed at a stage lands in it.
    options = RunOptions(workdir=workdir, timeout=timeout, tick_s=0.02)
    result = run_job(job, spec, options, on_tick=observer)
    return result, observer, spec


# -- what the process table and the logs say -----------------------------------------


def rollout_logs(workdir: Path) -> dict[str, str]:
    return {
        p.name: p.read_text(errors="replace")
        for p in sorted((workdir / "logs").glob("*-rollout-*.log"))
    }


def preempted_reason(log_text: str) -> str | None:
    """What a rank's log says it stopped for, as it reported it (None: it did not say)."""
    for line in log_text.splitlines():
        if ": preempted: " in line:
            return line.split(": preempted: ", 1)[1]
        if ": preempted (after " in line:
            return "after " + line.split(": preempted (after ", 1)[1].rstrip(")")
    return None


def stop_points(workdir: Path) -> dict[str, str]:
    """Log file -> why the rank said it was preempted, for every rank that said so."""
    out = {}
    for path in sorted((workdir / "logs").glob("*.log")):
        why = preempted_reason(path.read_text(errors="replace"))
        if why is not None:
            out[path.name] = why
    return out


@dataclass(frozen=True)
class Kill:
    pod: str
    #: "created": timed from the gang's creation (start-up, publishing, the barrier wait);
    #: "barrier": from the barrier's opening (connecting, refits).
    anchor: str
    delay: float


def seeded_kills(seed: int, count: int, topo: Topology, job: str, window: float) -> list[Kill]:
    """``count`` kills from ``seed`` (pure): a rank, an anchor (start-up or refits, half
    each) and a delay within ``window`` seconds of it."""
    rng = random.Random(seed)
    pods = [rank_name(job, "policy", r) for r in range(topo.policy)]
    pods += [rank_name(job, "rollout", r) for r in range(topo.rollout)]
    return [
        Kill(
            rng.choice(pods), rng.choice(("created", "barrier")), round(rng.uniform(0.0, window), 2)
        )
        for _ in range(count)
    ]
