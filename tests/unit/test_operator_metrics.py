"""The operator's metrics (``refit_operator.shell.metrics``): job series equal the status they
come from, each itemised refit is observed once however often a rank's report is read,
the time to resume after a preemption, and the exposition Prometheus parses.

Real: prometheus_client's registry, exposition and parser.  No API, no HTTP.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import create_model
from tests.support.rendezvous_maps import spread

from refit_operator.api.models import Phase, RefitJobStatus
from refit_operator.api.status import Condition, RoleStatus
from refit_operator.core.coordinate import decode
from refit_operator.shell.metrics import OperatorMetrics
from refit_worker.contract.rendezvous import ProgressEntry, RefitReport, encode_entry, progress_key


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


#: A round that read no rendezvous entries.
NO_ENTRIES = decode({})


def _samples(metrics: OperatorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _job(**fields: object) -> RefitJobStatus:
    return RefitJobStatus(**fields)  # type: ignore[arg-type]


def _progress(
    role: str, rank: int, epoch: int, reports: list[tuple[int, float]], uid: str = "u"
) -> dict[str, str]:
    entry = ProgressEntry(
        epoch=epoch,
        role=role,  # type: ignore[arg-type]
        rank=rank,
        uid=f"{uid}-{role}-{rank}-0000",
        refits_completed=reports[-1][0] + 1 if reports else 0,
        recent=tuple(RefitReport(refit=r, bytes=100, seconds=s) for r, s in reports),
    )
    key = progress_key(role, rank)  # type: ignore[arg-type]
    return {key: encode_entry(key, entry)}


def test_job_series_are_the_status() -> None:
    metrics = OperatorMetrics(process_metrics=False)
    metrics.set_leader(True)
    status = _job(
        phase=Phase.RUNNING,
        refits_completed=7,
        bytes_transferred=123_456_789,
        preemptions=2,
        restarts=1,
        epoch=3,
        last_throughput_bytes_per_second=5.5e9,
    )
    metrics.job_round("team-a", "demo", status, NO_ENTRIES)
    metrics.job_round(
        "team-b", "other", _job(phase=Phase.SUCCEEDED, refits_completed=3), NO_ENTRIES
    )
    got = _samples(metrics)
    job = (("job", "demo"), ("namespace", "team-a"))
    assert got[("refit_job_refits_total", job)] == 7
    assert got[("refit_job_transferred_bytes_total", job)] == 123_456_789
    assert got[("refit_job_preemptions_total", job)] == 2
    assert got[("refit_job_restarts_total", job)] == 1
    assert got[("refit_job_epoch", job)] == 3
    assert got[("refit_job_last_refit_bytes_per_second", job)] == 5.5e9
    phases = {labels[0][1]: v for (name, labels), v in got.items() if name == "refit_jobs"}
    assert phases == {p.value: (1 if p in (Phase.RUNNING, Phase.SUCCEEDED) else 0) for p in Phase}
    metrics.job_gone("team-a", "demo")
    assert ("refit_job_refits_total", job) not in _samples(metrics)
    # A replica that does not lead (a standby, or one stopping) exports no job series.
    metrics.set_leader(False)
    assert not any(name.startswith(("refit_job", "refit_jobs")) for name, _ in _samples(metrics))


def test_each_itemised_refit_is_observed_once() -> None:
    metrics = OperatorMetrics(process_metrics=False)
    status = _job(phase=Phase.RUNNING)
    shard = {**_progress("rollout", 0, 0, [(0, 0.2), (1, 0.3)]), **_progress("policy", 0, 0, [])}
    for _ in range(3):  # the same reports, read on three rounds
        metrics.job_round("ns", "j", status, decode(spread("j", shard)))
    shard = _progress("rollout", 0, 0, [(0, 0.2), (1, 0.3), (2, 7.0)])
    metrics.job_round("ns", "j", status, decode(spread("j", shard)))
    # A recreated gang (epoch 1) resumes at refit 3: its reports are new ones.
    shard = _progress("rollout", 0, 1, [(3, 0.4)])
    metrics.job_round("ns", "j", status, decode(spread("j", shard)))
    got = _samples(metrics)
    rollout = (("role", "rollout"),)
    assert got[("refit_refit_duration_seconds_count", rollout)] == 4
    assert round(got[("refit_refit_duration_seconds_sum", rollout)], 6) == 7.9
    assert got[("refit_refit_duration_seconds_bucket", (("le", "0.25"), ("role", "rollout")))] == 1
    # A bad entry is skipped (the status reports it), not fatal to the metrics.
    broken = decode(spread("j", {"progress.rollout.0": "{broken"}))
    metrics.job_round("ns", "j", status, broken)
    assert _samples(metrics)[("refit_refit_duration_seconds_count", rollout)] == 4


def test_time_to_resume_after_a_preemption() -> None:
    clock = Clock()
    metrics = OperatorMetrics(clock=clock, process_metrics=False)
    run = {"phase": Phase.RUNNING, "epoch": 0, "refits_completed": 4}
    metrics.job_round("ns", "j", _job(**run), NO_ENTRIES)
    clock.now = 100.0  # drained: the operator counts a preemption, bumps the epoch
    metrics.job_round(
        "ns",
        "j",
        _job(**{**run, "phase": Phase.RESTARTING, "epoch": 1, "preemptions": 1}),
        NO_ENTRIES,
    )
    clock.now = 130.0  # a second preemption before the gang resumed: the wait goes on
    metrics.job_round(
        "ns",
        "j",
        _job(**{**run, "phase": Phase.RESTARTING, "epoch": 2, "preemptions": 2}),
        NO_ENTRIES,
    )
    clock.now = 140.0  # the new gang is up, but has committed nothing yet
    metrics.job_round("ns", "j", _job(**{**run, "epoch": 2, "preemptions": 2}), NO_ENTRIES)
    assert _samples(metrics)[("refit_resume_seconds_count", ())] == 0
    clock.now = 145.5  # its first refit: 45.5 s after the first preemption
    metrics.job_round(
        "ns", "j", _job(**{**run, "epoch": 2, "preemptions": 2, "refits_completed": 5}), NO_ENTRIES
    )
    got = _samples(metrics)
    assert got[("refit_resume_seconds_count", ())] == 1
    assert got[("refit_resume_seconds_sum", ())] == 45.5


def test_operator_counters_and_leader_gauge() -> None:
    metrics = OperatorMetrics(process_metrics=True)
    metrics.api_error("POST", 409)
    metrics.api_error("POST", 409)
    metrics.api_error("GET", None)
    metrics.reconcile_seconds.observe(0.02)
    metrics.reconcile_errors.inc()
    metrics.set_leader(True)
    got = _samples(metrics)
    assert got[("refit_operator_api_errors_total", (("method", "POST"), ("status", "409")))] == 2
    assert (
        got[("refit_operator_api_errors_total", (("method", "GET"), ("status", "unreachable")))]
        == 1
    )
    assert got[("refit_operator_reconcile_duration_seconds_count", ())] == 1
    assert got[("refit_operator_reconcile_errors_total", ())] == 1
    assert got[("refit_operator_leader", ())] == 1
    assert any(name.startswith("process_") for name, _ in got)
    # Each operator has a registry of its own: a second one starts from nothing.
    assert ("refit_operator_reconcile_errors_total", ()) in _samples(OperatorMetrics())
    assert _samples(OperatorMetrics())[("refit_operator_reconcile_errors_total", ())] == 0


def _with_fields(model: type[Any], **fields: tuple[Any, Any]) -> Any:
    """``model`` with the failure-domain fields of docs/failure-domains.md, given as
    (type, default): the model's own where it has them, else a subclass declaring them by
    the doc's names (until the status gains them, the metrics read them where present)."""
    missing = {k: v for k, v in fields.items() if k not in model.model_fields}
    return create_model(f"{model.__name__}Shaped", __base__=model, **missing)  # type: ignore[call-overload]


def test_per_role_and_per_replica_series_are_the_status() -> None:
    metrics = OperatorMetrics(process_metrics=False)
    metrics.set_leader(True)
    role = _with_fields(RoleStatus, desired=(int, 0), replacements=(int, 0))
    replica = create_model(
        "Replica", rank=(int, 0), generation=(int, 0), last_committed_refit=(int, -1)
    )
    shape = create_model(  # type: ignore[call-overload]
        "StatusShaped",
        __base__=_with_fields(RefitJobStatus, rollout_replicas=(list[replica], [])),  # type: ignore[valid-type]
        policy=(role, role()),  # the roles' status as shaped above
        rollout=(role, role()),
    )
    condition = Condition(
        type="RolloutDegraded",
        status="True",
        reason="ReplicaReplaced",
        last_transition_time=datetime(2026, 12, 1, tzinfo=UTC),
    )
    # Plain data by the doc's field names, validated by whichever model holds them.
    status = shape(
        phase=Phase.RUNNING,
        restarts=2,
        policy={"ready": 2, "total": 2, "desired": 2},
        rollout={"ready": 2, "total": 3, "desired": 3, "replacements": 5},
        rollout_replicas=[
            {"rank": 0, "generation": 0, "pod": "demo-rollout-0-g0", "last_committed_refit": 9},
            {"rank": 1, "generation": 4, "pod": "demo-rollout-1-g4", "last_committed_refit": 7},
        ],
        conditions=[condition],
    )
    metrics.job_round("team-a", "demo", status, NO_ENTRIES)
    got = _samples(metrics)

    def of(name: str, **labels: str) -> float:
        key = tuple(sorted({"namespace": "team-a", "job": "demo", **labels}.items()))
        return got[(name, key)]

    assert of("refit_job_role_ready_pods", role="rollout") == 2
    assert of("refit_job_role_pods", role="rollout") == 3
    assert of("refit_job_role_desired_replicas", role="rollout") == 3
    assert of("refit_job_role_desired_replicas", role="policy") == 2
    assert of("refit_job_role_replacements_total", role="rollout") == 5
    assert of("refit_job_restarts_total") == 2  # the policy gang's restarts
    assert of("refit_job_rollout_replica_generation", rank="1") == 4
    assert of("refit_job_rollout_replica_last_committed_refit", rank="0") == 9
    assert of("refit_job_rollout_degraded") == 1


def test_a_status_without_the_role_fields_exports_no_made_up_samples() -> None:
    metrics = OperatorMetrics(process_metrics=False)
    metrics.set_leader(True)
    plain = RefitJobStatus(rollout=RoleStatus(ready=1, total=2))
    metrics.job_round("team-a", "demo", plain, NO_ENTRIES)
    got = _samples(metrics)
    names = {name for name, _ in got}
    assert (
        got[
            ("refit_job_role_pods", (("job", "demo"), ("namespace", "team-a"), ("role", "rollout")))
        ]
        == 2
    )
    # What this status does not hold is absent, not zero.
    absent = {n for n in ("refit_job_rollout_degraded", "refit_job_rollout_replica_generation")}
    if "desired" not in RoleStatus.model_fields:
        absent.add("refit_job_role_desired_replicas")
    assert not names & absent
