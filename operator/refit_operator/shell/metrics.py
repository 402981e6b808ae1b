"""The operator's Prometheus metrics: what its jobs' status says, and how its own work goes.

Job figures are exported from the last status this process wrote for each job (the same
numbers ``kubectl get rj -o yaml`` shows, so a scrape and the status always agree), the
way kube-state-metrics exports objects: counters such as ``refit_job_refits_total`` are
the job's own monotonic counts, so a standby that takes over exports the same values,
and ``rate()`` sees no reset.  Per-refit durations come from the ranks' itemised reports
(the last 8 refits of each rank's progress entry), each observed once per process: a
report is identified by (job, epoch, role, rank, refit).

Per role (``role`` label: policy, rollout): pods ready, pods, replicas desired, and the
rollout's replacements (``status.policy`` / ``status.rollout``); per rollout replica its
generation, last committed refit and seconds from its pod's start to serving
(``status.rolloutReplicas``), the replicas serving now by where their pod's first refit
came from (a rollout peer's seed or the policy's send), and whether the job is
``RolloutDegraded``.  Seedings as this process saw them happen are counted apart
(``refit_rollout_seeds_total``).  The field names are those of docs/failure-domains.md,
read where the status has them (a field it lacks exports no sample).

The operator's own work: reconcile duration and errors, the API's error answers by
status, and whether this replica leads.

The HTTP side is ``endpoints``.  The ranks'
entries arrive decoded: the reconcile round decoded the rendezvous map once
(``Observed.entries``), and the metrics read that decoding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from refit_operator.api.models import Phase, RefitJobStatus
from refit_operator.api.status import seed_kind
from refit_operator.core.coordinate import Decoded
from refit_worker.contract.rendezvous import ProgressEntry, RefitReport

#: Refit durations: from a small model on one host (~0.1 s) to a large one over a slow
#: network (~10 min).
REFIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: From a preemption to the new gang's first refit: pods rescheduled, processes started,
#: NIXL agents published, one refit moved.
RESUME_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
#: One reconcile round: a few GETs and writes, more for a large gang's creation.
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

JobKey = tuple[str, str]  # namespace, name
#: (namespace, job, epoch, role, rank): a rank's reports; the value is its highest refit seen.
RankKey = tuple[str, str, int, str, int]


@dataclass(frozen=True)
class _PendingResume:
    """A preemption seen at ``since`` (process clock), waiting for the next refit."""

    since: float
    epoch: int
    refits: int


class OperatorMetrics:
    """All metrics of one operator process, in a registry of its own (tests run several)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        process_metrics: bool = True,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        self._jobs: dict[JobKey, RefitJobStatus] = {}
        self._reports: dict[RankKey, int] = {}
        self._resume: dict[JobKey, _PendingResume] = {}
        reg = self.registry
        self.reconcile_seconds = Histogram(
            "refit_operator_reconcile_duration_seconds",
            "Time of one reconcile round of one RefitJob (read, decide, write).",
            buckets=RECONCILE_BUCKETS,
            registry=reg,
        )
        self.reconcile_errors = Counter(
            "refit_operator_reconcile_errors",
            "Reconcile rounds that ended in an error (retried with back-off).",
            registry=reg,
        )
        self.api_errors = Counter(
            "refit_operator_api_errors",
            "Error answers of the Kubernetes API to the operator's own client, by HTTP "
            "status ('unreachable' when no answer came).",
            ["method", "status"],
            registry=reg,
        )
        self.refit_seconds = Histogram(
            "refit_refit_duration_seconds",
            "Seconds one refit took on one rank (transfer and commit), as the rank reported.",
            ["role"],
            buckets=REFIT_BUCKETS,
            registry=reg,
        )
        self.resume_seconds = Histogram(
            "refit_resume_seconds",
            "Seconds from a preemption (a drain, an eviction) to the new gang's first "
            "committed refit, as this operator replica saw them.",
            buckets=RESUME_BUCKETS,
            registry=reg,
        )
        self.seeds = _seeds_counter(reg)
        self._leader = Gauge(
            "refit_operator_leader",
            "1 while this replica holds the leader Lease (or runs without election).",
            registry=reg,
        )
        self.leading = False
        reg.register(_JobCollector(self._jobs, lambda: self.leading))
        if process_metrics:
            ProcessCollector(registry=reg)
            PlatformCollector(registry=reg)

    # -- what the controller tells -------------------------------------------------------

    def job_round(
        self,
        namespace: str,
        name: str,
        status: RefitJobStatus,
        entries: Decoded,
    ) -> None:
        """One reconcile round of a job wrote ``status``, having decoded ``entries``."""
        key = (namespace, name)
        before = self._jobs.get(key)
        self._track_resume(key, before, status)
        for source in new_seeds(before, status):
            self.seeds.labels(namespace=namespace, job=name, source=source).inc()
        self._jobs[key] = status
        reports = new_refit_reports(namespace, name, entries.progress(), self._reports)
        for role, duration in reports:
            self.refit_seconds.labels(role=role).observe(duration)

    def job_gone(self, namespace: str, name: str) -> None:
        """The job was deleted: its series go, and so does what was kept to dedupe."""
        key = (namespace, name)
        self._jobs.pop(key, None)
        self._resume.pop(key, None)
        for rank in [k for k in self._reports if k[:2] == key]:
            del self._reports[rank]
        for source in SEED_SOURCES:
            self.seeds.remove(namespace, name, source)

    def set_leader(self, leading: bool) -> None:
        """Job series are exported while this replica leads (a standby knows no jobs)."""
        self.leading = leading
        self._leader.set(1 if leading else 0)

    def api_error(self, method: str, status: int | None) -> None:
        self.api_errors.labels(method=method, status=str(status or "unreachable")).inc()

    # -- resume after a preemption -------------------------------------------------------

    def _track_resume(
        self, key: JobKey, before: RefitJobStatus | None, after: RefitJobStatus
    ) -> None:
        pending = self._resume.get(key)
        if before is not None and after.preemptions > before.preemptions and pending is None:
            # The first preemption counts: a second one before the gang resumed only
            # makes the wait longer.
            self._resume[key] = _PendingResume(
                self._clock(), epoch=after.epoch, refits=after.refits_completed
            )
        elif pending is not None and resumed(pending.epoch, pending.refits, after):
            self.resume_seconds.observe(max(0.0, self._clock() - pending.since))
            del self._resume[key]
        if after.phase in (Phase.SUCCEEDED, Phase.FAILED):
            self._resume.pop(key, None)


def resumed(epoch: int, refits: int, status: RefitJobStatus) -> bool:
    """Whether ``status`` shows a refit committed in ``epoch`` or later, past ``refits``."""
    return status.epoch >= epoch and status.refits_completed > refits


def _seeds_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "refit_rollout_seeds",
        "Rollout pods that came to serve, by where their first committed refit came "
        "from: 'peer' (seeded by a live rollout replica) or 'policy' (the policy's "
        "send), as this operator replica saw them happen.",
        ["namespace", "job", "source"],
        registry=registry,
    )


#: Where a rollout pod's first committed refit came from (``refit_operator.api.status.seed_kind``).
SEED_SOURCES = ("peer", "policy")


def new_seeds(before: RefitJobStatus | None, after: RefitJobStatus) -> Iterator[str]:
    """The source kind of each replica whose pod's seed shows in ``after`` and not in
    ``before``.  Without ``before`` (a new process, a takeover) the seeds already in the
    status happened unseen and are not counted."""
    if before is None:
        return
    known = {(r.rank, r.pod) for r in before.rollout_replicas if r.seeded_from is not None}
    for replica in after.rollout_replicas:
        kind = seed_kind(replica)
        if kind is not None and (replica.rank, replica.pod) not in known:
            yield kind


def new_refit_reports(
    namespace: str,
    name: str,
    progress: Iterable[ProgressEntry],
    seen: dict[RankKey, int],
) -> Iterator[tuple[str, float]]:
    """(role, seconds) of every itemised refit in the ranks' ``progress`` entries not yet
    in ``seen``.

    Ranks report their refits in order, so the highest refit seen per rank and epoch is
    enough to tell a new report from one already counted; ``seen`` is updated.  Entries
    that did not decode are not among them (the reconcile reports those in the status).
    """
    for entry in progress:
        rank: RankKey = (namespace, name, entry.epoch, entry.role, entry.rank)
        last = seen.get(rank, -1)
        fresh: list[RefitReport] = [r for r in entry.recent if r.refit > last]
        for report in fresh:
            yield entry.role, report.seconds
        if fresh:
            seen[rank] = fresh[-1].refit


class _JobCollector(Collector):
    """Job series from the statuses the controller wrote last (read at scrape time)."""

    def __init__(self, jobs: Mapping[JobKey, RefitJobStatus], leading: Callable[[], bool]) -> None:
        self._jobs, self._leading = jobs, leading

    def collect(self) -> Iterator[Metric]:
        if not self._leading():
            return
        labels = ["namespace", "job"]
        phases = GaugeMetricFamily(
            "refit_jobs", "RefitJobs this operator reconciles, by phase.", labels=["phase"]
        )
        refits = CounterMetricFamily(
            "refit_job_refits",
            "Refits every rollout rank committed (status.refitsCompleted).",
            labels=labels,
        )
        moved = CounterMetricFamily(
            "refit_job_transferred_bytes",
            "Bytes the rollout ranks received, over all epochs (status.bytesTransferred).",
            labels=labels,
        )
        preemptions = CounterMetricFamily(
            "refit_job_preemptions",
            "Gang preemptions: drains, evictions, deletions (status.preemptions).",
            labels=labels,
        )
        restarts = CounterMetricFamily(
            "refit_job_restarts",
            "Policy-gang restarts after real failures (status.restarts).",
            labels=labels,
        )
        throughput = GaugeMetricFamily(
            "refit_job_last_refit_bytes_per_second",
            "Throughput of the job's last refit (status.lastThroughputBytesPerSecond).",
            labels=labels,
        )
        epoch = GaugeMetricFamily(
            "refit_job_epoch", "The job's current gang epoch (status.epoch).", labels=labels
        )
        counts = dict.fromkeys(Phase, 0)
        for (namespace, name), status in sorted(dict(self._jobs).items()):
            counts[status.phase] += 1
            values = [namespace, name]
            refits.add_metric(values, status.refits_completed)
            moved.add_metric(values, status.bytes_transferred)
            preemptions.add_metric(values, status.preemptions)
            restarts.add_metric(values, status.restarts)
            epoch.add_metric(values, status.epoch)
            if status.last_throughput_bytes_per_second is not None:
                throughput.add_metric(values, status.last_throughput_bytes_per_second)
        for phase, count in counts.items():
            phases.add_metric([phase.value], count)
        yield from (phases, refits, moved, preemptions, restarts, throughput, epoch)
        yield from role_families(dict(self._jobs))
        yield from seed_families(dict(self._jobs))


#: (metric name, help, RoleStatus field, counter?) of each per-role series.
_ROLE_SERIES = (
    (
        "refit_job_role_ready_pods",
        "Pods of the role that are Ready (status.<role>.ready).",
        "ready",
        False,
    ),
    ("refit_job_role_pods", "Pods of the role that exist (status.<role>.total).", "total", False),
    (
        "refit_job_role_desired_replicas",
        "Replicas the spec asks of the role (status.<role>.desired).",
        "desired",
        False,
    ),
    (
        "refit_job_role_replacements",
        "Replicas of the role replaced alone, after failures and preemptions "
        "(status.rollout.replacements).",
        "replacements",
        True,
    ),
)
_ROLES = ("policy", "rollout")


def role_families(jobs: Mapping[JobKey, RefitJobStatus]) -> Iterator[Metric]:
    """The per-role and per-replica series of ``jobs``; a status field that is absent
    (an older status) exports no sample, never a made-up zero."""
    labels = ["namespace", "job", "role"]
    families: list[GaugeMetricFamily | CounterMetricFamily] = [
        (CounterMetricFamily if counter else GaugeMetricFamily)(name, text, labels=labels)
        for name, text, _, counter in _ROLE_SERIES
    ]
    replica = ["namespace", "job", "rank"]
    generation = GaugeMetricFamily(
        "refit_job_rollout_replica_generation",
        "Generation of the rollout replica's live pod (status.rolloutReplicas[].generation).",
        labels=replica,
    )
    committed = GaugeMetricFamily(
        "refit_job_rollout_replica_last_committed_refit",
        "The last refit the rollout replica committed "
        "(status.rolloutReplicas[].lastCommittedRefit).",
        labels=replica,
    )
    degraded = GaugeMetricFamily(
        "refit_job_rollout_degraded",
        "1 while fewer rollout replicas serve than desired (condition RolloutDegraded).",
        labels=["namespace", "job"],
    )
    for (namespace, name), status in sorted(jobs.items()):
        for role in _ROLES:
            of_role = getattr(status, role, None)
            for family, (_, _, field, _) in zip(families, _ROLE_SERIES, strict=True):
                value = getattr(of_role, field, None)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    family.add_metric([namespace, name, role], value)
        for entry in getattr(status, "rollout_replicas", None) or ():
            rank = str(getattr(entry, "rank", ""))
            for family, field in ((generation, "generation"), (committed, "last_committed_refit")):
                value = getattr(entry, field, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    family.add_metric([namespace, name, rank], value)
        truth = next((c.status for c in status.conditions if c.type == "RolloutDegraded"), None)
        if truth is not None:
            degraded.add_metric([namespace, name], 1.0 if truth == "True" else 0.0)
    yield from (*families, generation, committed, degraded)


def seed_families(jobs: Mapping[JobKey, RefitJobStatus]) -> Iterator[Metric]:
    """How the rollout replicas serving now came to serve (``status.rolloutReplicas[]``'s
    ``seededFrom`` and ``secondsToServing``); a replica not yet serving counts in neither."""
    seeded = GaugeMetricFamily(
        "refit_job_rollout_replicas_seeded",
        "Rollout replicas whose pod's first committed refit came from 'peer' (a live "
        "rollout replica seeded it) or 'policy' (the policy's send) "
        "(status.rolloutReplicas[].seededFrom).",
        labels=["namespace", "job", "source"],
    )
    serving = GaugeMetricFamily(
        "refit_job_rollout_replica_seconds_to_serving",
        "Seconds from the rollout replica's pod start to its first committed refit "
        "(status.rolloutReplicas[].secondsToServing).",
        labels=["namespace", "job", "rank"],
    )
    for (namespace, name), status in sorted(jobs.items()):
        counts = dict.fromkeys(SEED_SOURCES, 0)
        for replica in status.rollout_replicas:
            kind = seed_kind(replica)
            if kind is not None:
                counts[kind] += 1
            if replica.seconds_to_serving is not None:
                serving.add_metric([namespace, name, str(replica.rank)], replica.seconds_to_serving)
        for source, count in counts.items():
            seeded.add_metric([namespace, name, source], count)
    yield from (seeded, serving)
