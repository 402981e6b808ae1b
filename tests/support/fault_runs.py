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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from refit_operator.api import names
from refit_operator.api.models import RefitJobSpec, RefitJobStatus, parse_spec
from refit_operator.core.coordinate import merged
from refit_operator.local.runner import LocalCluster, RunOptions, RunResult, run_job
from refit_worker.contract.rendezvous import EntryError, Snapshot, read_snapshot
from refit_worker.contract.roles import Role


@dataclass(frozen=True)
class Topology:
    policy: int
    rollout: int

    def __str__(self) -> str:
        return f"({self.policy},{self.rollout})"


TOPOLOGIES = (Topology(1, 1), Topology(2, 2), Topology(1, 3))

_Case = TypeVar("_Case")
#: Set to 1 to run every case of the reliability matrices under pytest, not CI's sample.
FULL_MATRIX_ENV = "REFIT_FULL_MATRIX"


def sampled(cases: Sequence[_Case], keep: Sequence[_Case]) -> list[_Case]:
    """The cases a test runs: ``keep`` (CI's fixed sample, a few minutes of a 2-core
    machine), or all of ``cases`` with ``REFIT_FULL_MATRIX=1``.  The whole matrix always
    runs in ``bench/reliability_report.py``, which regenerates docs/reliability.md."""
    missing = [case for case in keep if case not in cases]
    if missing:
        raise ValueError(f"sampled cases {missing} are not among the cases {list(cases)}")
    return list(cases) if os.environ.get(FULL_MATRIX_ENV) == "1" else list(keep)


class Stage(StrEnum):
    BEFORE_BARRIER = "before the barrier"
    METADATA = "during metadata exchange"
    MID_BUCKET = "mid-bucket"
    BETWEEN_REFITS = "between refits"
    FINAL_COMMIT = "during the final commit"


#: Longest a rank is held back to catch the metadata exchange half-done.
HOLD_LIMIT_S = 30.0
#: After a rollout rank's commit (and the policy gang's hold), when the rank is surely past
#: its refit-boundary check and waiting for the next refit's buckets.
MID_BUCKET_DELAY_S = 0.25

#: The order one job meets the stages in, one drain per round: the metadata exchange of
#: the job's first opening; the replacement before the membership admits it; then, each
#: time the rank's new pod is a member again, the stages inside refits.
STAGES = (
    Stage.METADATA,
    Stage.BEFORE_BARRIER,
    Stage.MID_BUCKET,
    Stage.BETWEEN_REFITS,
    Stage.FINAL_COMMIT,
)


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
    max_replacements: int = 20,
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
            "rollout": {
                "replicas": topo.rollout,
                "failurePolicy": {
                    "maxReplacements": max_replacements,
                    "backoffSeconds": backoff,
                    "maxBackoffSeconds": backoff * 4,
                },
            },
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
    CONNECT = "waiting for the barrier (not, or no longer, a member)"
    BUCKET = "at a bucket boundary inside a refit"
    #: The drain took the pod out of the membership while a refit was in flight: the rank
    #: abandoned it (nothing committed), then met its stop signal waiting to rejoin.  Which
    #: of the two reaches the rank first (the coordinator's barrier or the preStop's signal)
    #: is up to the scheduler, so a stop inside a refit is this or BUCKET.
    ABANDONED = "inside a refit, abandoned as the drain took it out of the membership"
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
    if message.startswith(ABANDONED_PREFIX):
        return StopPoint.ABANDONED
    if (
        message.startswith("signal received by")
        or "posted a preemption notice" in message
        or "a peer left" in message
    ):
        return StopPoint.BOUNDARY
    if "while waiting for the barrier" in message or "preempt" in message.lower():
        return StopPoint.CONNECT  # the barrier wait raised Preempted
    return StopPoint.OTHER


_COMMITTED = re.compile(r"rollout rank \d+: refit (\d+) committed")


def committed_refits(log_text: str) -> list[int]:
    """Refit ids a rollout rank's log says it committed, in order (pure)."""
    return [int(m.group(1)) for m in _COMMITTED.finditer(log_text)]


_SEEDED = re.compile(r"rollout rank \d+: seeded refit (\d+) from ")


def sent_refits(log_text: str) -> list[int]:
    """The refits a rollout rank committed from the policy's sends, in order: its first
    commit left out when a peer seeded it (issue #31: the version served when it joined,
    which may be followed by a gap, the refit already on its way to the others) (pure)."""
    ids = committed_refits(log_text)
    seeded = _SEEDED.search(log_text)
    if seeded is not None and ids and ids[0] == int(seeded.group(1)):
        return ids[1:]
    return ids


# -- watching a run --------------------------------------------------------------------

_POD = re.compile(r"-(?P<role>policy|rollout)-(?P<rank>\d+)-(?P<kind>[eg])(?P<n>\d+)$")


def rank_of(pod: str) -> tuple[Role, int] | None:
    """(role, rank) of a pod named ``<job>-<role>-<rank>-e<epoch>|g<generation>`` (pure)."""
    found = _POD.search(pod)
    if found is None:
        return None
    role: Role = "policy" if found["role"] == "policy" else "rollout"
    return role, int(found["rank"])


def incarnation_of(pod: str) -> int:
    """The epoch (policy) or generation (rollout) in a pod's name; -1 if none (pure)."""
    found = _POD.search(pod)
    return int(found["n"]) if found else -1


@dataclass
class EpochView:
    """One tick's view of the job: pods, rendezvous, processes."""

    epoch: int
    snap: Snapshot | None
    #: (pod name, uid) of this epoch's policy pods and of the live rollout pods.
    pods: list[tuple[str, str]]
    pids: dict[str, int]
    refits: int

    @property
    def published(self) -> int:
        return len(self.snap.meta) if self.snap else 0

    @property
    def barrier_open(self) -> bool:
        return bool(self.snap and self.snap.barrier)

    def member(self, pod: str) -> bool:
        """Whether ``pod`` (a live pod of this view) holds its rank in the membership now."""
        barrier = self.snap.barrier if self.snap else None
        uid = dict(self.pods).get(pod)
        slot = rank_of(pod)
        if barrier is None or uid is None or slot is None:
            return False
        held = barrier.holder(*slot)
        return held is not None and held.uid == uid

    def own_last_refit(self, pod: str) -> int:
        """The last refit ``pod``'s own report says it committed (-1: none; a joiner's
        first report may count refits from before it joined, so the count is no sign)."""
        slot, uid = rank_of(pod), dict(self.pods).get(pod)
        report = self.snap.progress.get(slot) if self.snap and slot else None
        if report is None or report.uid != uid or report.last_refit is None:
            return -1
        return report.last_refit.refit

    def committed(self) -> int:
        """The most refits any rollout rank reported committed."""
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


def _in_view(pod: Mapping[str, Any], epoch: int) -> bool:
    labels = pod["metadata"].get("labels") or {}
    if labels.get(names.LABEL_ROLE) == "policy":
        return bool(labels.get(names.LABEL_EPOCH) == str(epoch))
    return "deletionTimestamp" not in pod["metadata"]


def view_of(status: RefitJobStatus, cluster: LocalCluster) -> EpochView:
    epoch = status.epoch
    # The epoch's policy pods, and the rollout pods serving it (created in any epoch).
    pods = [p for p in cluster.kubelet.pods() if _in_view(p, epoch)]
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
    """One injected fault and what followed it.

    Per-role failure domains: a fault on a rollout pod stops that pod alone and is over
    once its replacement holds the rank in the membership; one on a policy pod stops the
    policy gang and is over once the next epoch's barrier opened.
    """

    kind: str  # "drain" or "kill"
    epoch: int
    target: str
    stage: str
    #: What the tick saw when the fault went in.
    published: int
    barrier_open: bool
    committed: int
    #: Whether the target held its rank in the membership then.
    member: bool
    at: float
    #: (pod name, uid) of the pods the fault stops: the target, or its policy gang.
    old_pods: list[tuple[str, str]]
    #: The last refit the target's own report said it committed then (-1: none): with
    #: two rollout ranks, ``committed`` (any rank's) may be the job's last while the
    #: target's rank is a refit behind, not done, and so replaced.
    target_refit: int = -1
    #: Seconds until every one of ``old_pods`` had exited (None: not seen).
    stopped_s: float | None = None
    #: Seconds until the replacement existed: the next epoch's gang, or the rollout
    #: rank's next generation (None: not seen).
    restarted_s: float | None = None
    #: Seconds until the replacement took part: the next epoch's barrier open, or the new
    #: rollout pod a member (None: not seen).
    recovered_s: float | None = None

    @property
    def role(self) -> Role | None:
        slot = rank_of(self.target)
        return slot[0] if slot else None


def _replaced(fault: Fault, view: EpochView, status: RefitJobStatus) -> bool:
    if fault.role == "policy":
        return view.epoch > fault.epoch and status.created_epoch == view.epoch
    slot = rank_of(fault.target)
    return any(
        rank_of(name) == slot and incarnation_of(name) > incarnation_of(fault.target)
        for name, _ in view.pods
    )


def _rejoined(fault: Fault, view: EpochView) -> bool:
    if fault.role == "policy":
        return view.epoch > fault.epoch and view.barrier_open
    slot = rank_of(fault.target)
    return any(
        rank_of(name) == slot and name != fault.target and view.member(name)
        for name, _ in view.pods
    )


#: (kind "drain" or "kill", rank name, what the plan calls the moment)
Choice = tuple[str, str, str]


class Plan:
    """When to inject what; :meth:`decide` is asked once per tick until it answers.

    ``round_`` counts the faults already in; ``settled``: the last one is over (its
    replacement takes part), or for the first round, the barrier opened.
    """

    def decide(self, view: EpochView, round_: int, settled: bool) -> Choice | None:
        raise NotImplementedError

    def after(self, view: EpochView, round_: int) -> None:
        """Called right after a fault went in (e.g. to let a held rank go)."""

    def tick(self, faults: list[Fault]) -> None:
        """Called every tick with the faults so far (e.g. to let a held rank go once a
        drained pod stopped)."""


@dataclass
class Observer:
    """Asks ``plan`` each tick; a returned choice injects a fault and records what followed.

    The next fault is asked for only once the last one's replacement exists, so each
    fault meets a job that is whole again (or becoming so).
    """

    plan: Plan
    faults: list[Fault] = field(default_factory=list)
    max_faults: int = 1
    #: (pod name, uid) -> exit code, as the run's kubelet recorded them.
    exit_codes: dict[tuple[str, str], int] = field(default_factory=dict)

    def __call__(self, status: RefitJobStatus, cluster: LocalCluster) -> None:
        self.exit_codes = cluster.kubelet.exit_codes  # the live dict, kept after the run
        view = view_of(status, cluster)
        now = time.monotonic()
        self.plan.tick(self.faults)
        for fault in self.faults:
            if fault.stopped_s is None and all(
                key in cluster.kubelet.exit_codes for key in fault.old_pods
            ):
                fault.stopped_s = now - fault.at
            if fault.restarted_s is None and _replaced(fault, view, status):
                fault.restarted_s = now - fault.at
            if (
                fault.recovered_s is None
                and fault.restarted_s is not None
                and _rejoined(fault, view)
            ):
                fault.recovered_s = now - fault.at
        if len(self.faults) >= self.max_faults or not view.pods:
            return
        if status.created_epoch != view.epoch:
            return
        last = self.faults[-1] if self.faults else None
        if last is not None and last.restarted_s is None:
            return
        settled = view.barrier_open if last is None else last.recovered_s is not None
        choice = self.plan.decide(view, len(self.faults), settled)
        if choice is None:
            return
        kind, rank, stage = choice
        target = live_pod(view, rank)
        uid = dict(view.pods).get(target)
        if uid is None:
            return
        # A policy fault stops the policy gang; a rollout one, that pod alone.
        stops = [(target, uid)]
        if target.startswith(f"{rank}-e"):
            stops = [(n, u) for n, u in view.pods if n.rsplit("-", 1)[1].startswith("e")]
        fault = Fault(
            kind,
            view.epoch,
            target,
            stage,
            view.published,
            view.barrier_open,
            view.committed(),
            view.member(target),
            now,
            stops,
            target_refit=view.own_last_refit(target),
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
        self.plan.after(view, len(self.faults) - 1)


# -- drains at stages ------------------------------------------------------------------


@dataclass
class StagePlan(Plan):
    """Decides, per round, when the drain of that round's stage goes in.

    Every drain is of the last rollout rank, whichever pod holds it by then; the policy
    pods run on throughout.  For the metadata exchange (the first round: only an epoch's
    first opening has one) policy rank 0 is held (SIGSTOP) before it can publish, so the
    exchange is caught half-done every time; it is let go (SIGCONT) right after the
    drain, or after ``HOLD_LIMIT_S`` whatever happens.  *Before the barrier* is the
    replacement of that drain, running but not yet admitted to the membership.  The
    stages inside refits wait until the rank's pod is a member again; for *mid-bucket*
    the policy gang is held (SIGSTOP) as soon as the rank's pod reports a commit, before
    it is far into the next refit, and for *the final commit* as soon as it reports the
    next-to-last; the drain goes in once the rank is waiting for that refit's buckets,
    and the gang is let go once the drained pod exited, so the stop meets the transfer
    however long the preStop hook and the signal take.
    """

    stages: tuple[Stage, ...]
    refits: int
    #: The rollout rank to drain (its name without the generation).
    target: str
    rollout_ranks: int
    #: The policy rank held back for the metadata stage.
    held_pod: str
    #: The last refit the round's target pod had reported committed when it became a
    #: member (-1: none).
    _own_base: dict[int, int] = field(default_factory=dict)

    _held: dict[int, tuple[int, float]] = field(default_factory=dict)
    #: Round -> (policy pids held inside a transfer, since when).
    _gang_held: dict[int, tuple[list[int], float]] = field(default_factory=dict)

    def decide(self, view: EpochView, round_: int, settled: bool) -> Choice | None:
        if round_ >= len(self.stages):
            return None
        stage = self.stages[round_]
        pod = live_pod(view, self.target)
        if stage is Stage.METADATA:
            hit = self._half_published(view, round_)
        elif stage is Stage.BEFORE_BARRIER:
            hit = pod in view.pids and not view.member(pod)
        elif not view.member(pod):
            return None
        else:
            own = view.own_last_refit(pod)
            if stage is Stage.FINAL_COMMIT:
                # The rank committed the next-to-last refit (or the last, on a slow tick):
                # what it waits for, or has, is the final one.
                hit = own >= self.refits - 2
            else:
                # Right as the rank's pod reports a commit of its own (it is in the refit
                # loop, not still joining): the next refit is only starting, and the
                # rank's transfer with it (it waits for buckets from its commit on).
                hit = own > self._own_base.setdefault(round_, own)
            if hit and stage in (Stage.MID_BUCKET, Stage.FINAL_COMMIT):
                # Hold the policy gang before it is far into the next refit, then drain
                # once the rank is past its check at the refit boundary (right after its
                # commit), waiting for the next refit's buckets.  Held, the gang cannot
                # finish the job first: the final drain never depends on a tick landing
                # in the last refit's fraction of a second.
                if round_ not in self._gang_held:
                    self._hold_policy(view, round_)
                _, since = self._gang_held[round_]
                hit = time.monotonic() - since >= MID_BUCKET_DELAY_S
        return ("drain", self.target, stage.value) if hit else None

    def _hold_policy(self, view: EpochView, round_: int) -> None:
        """Stop the policy gang's processes inside the transfer, so the drained rank's
        stop meets it there however long the stop takes to arrive (preStop, signal);
        :meth:`tick` lets them go once the drained pod exited."""
        pids = [view.pids[n] for n, _ in view.pods if n in view.pids and "-policy-" in n]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        self._gang_held[round_] = (pids, time.monotonic())

    def tick(self, faults: list[Fault]) -> None:
        for round_, (pids, since) in list(self._gang_held.items()):
            stopped = round_ < len(faults) and faults[round_].stopped_s is not None
            if stopped or time.monotonic() - since > HOLD_LIMIT_S:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                del self._gang_held[round_]

    def _half_published(self, view: EpochView, round_: int) -> bool:
        """Hold policy rank 0: no policy rank can publish (they join their gloo group
        first), so the exchange stops once every rollout rank published."""
        if round_ not in self._held:
            held = view.pids.get(live_pod(view, self.held_pod))
            if held is None or view.published > 0 or view.barrier_open:
                return False
            os.kill(held, signal.SIGSTOP)
            self._held[round_] = (held, time.monotonic())
        _, since = self._held[round_]
        if time.monotonic() - since > HOLD_LIMIT_S:
            self.after(view, round_)
            return False
        return view.published == self.rollout_ranks and not view.barrier_open

    def after(self, view: EpochView, round_: int) -> None:
        held = self._held.get(round_)
        if held is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(held[0], signal.SIGCONT)


@dataclass
class KillPlan(Plan):
    """Round i: SIGKILL rank ``kills[i].pod``'s live pod ``kills[i].delay`` s after the
    round began (anchor "created": the last fault's replacement exists, or the job's
    gang was created) or after it settled (anchor "barrier": that replacement takes part,
    or the first barrier opened)."""

    kills: list[Kill]
    _since: dict[int, float] = field(default_factory=dict)

    def decide(self, view: EpochView, round_: int, settled: bool) -> Choice | None:
        if round_ >= len(self.kills):
            return None
        kill = self.kills[round_]
        if kill.anchor == "barrier" and not settled:
            return None
        since = self._since.setdefault(round_, time.monotonic())
        if time.monotonic() - since < kill.delay:
            return None
        return "kill", kill.pod, phase_of(view, live_pod(view, kill.pod))


def phase_of(view: EpochView, pod: str) -> str:
    """Where the job was, as the rendezvous shows it, for ``pod`` (pure)."""
    if not view.barrier_open:
        return f"before the barrier ({view.published}/{len(view.pods)} published)"
    if not view.member(pod):
        return "barrier open, this pod not a member yet"
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
    return max(found, key=incarnation_of, default=rank)


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


#: Put before the reason of a rank that abandoned a refit in flight and then stopped.
ABANDONED_PREFIX = "refit in flight abandoned, then: "


def preempted_reason(log_text: str) -> str | None:
    """What a rank's log says it stopped for, as it reported it (None: it did not say);
    a stop that followed an abandoned refit says so first (:data:`ABANDONED_PREFIX`)."""
    abandoned = False
    for line in log_text.splitlines():
        if "refit in flight abandoned" in line:
            abandoned = True
        if ": preempted: " in line:
            why = line.split(": preempted: ", 1)[1]
            waiting = "while waiting for the barrier" in why
            return ABANDONED_PREFIX + why if abandoned and waiting else why
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
