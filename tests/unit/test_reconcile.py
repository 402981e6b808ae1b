"""The pure reconcile: job + observed children -> actions + next status (no API).

Pods are given as manifests (the way the API returns them) and read by ``observe``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from tests.support.reconcile_harness import (
    NOW,
    RUNNING,
    SUCCEEDED,
    Harness,
)
from tests.support.reconcile_harness import creates as _creates
from tests.support.reconcile_harness import deletes as _deletes
from tests.support.reconcile_harness import events as _events
from tests.support.rendezvous_maps import spread

from refit_operator.api.models import Phase, PodBytes, RefitJobStatus
from refit_operator.core.coordinate import PatchData
from refit_operator.core.decision import Create, Delete, Emit, JobView
from refit_operator.core.observe import observe, observe_pod
from refit_operator.core.phases import PhaseFacts, next_phase
from refit_operator.core.reconcile import reconcile
from refit_operator.core.steps.restart import POLL_DELETING_S
from refit_operator.render.pods import JobRef, RenderOptions
from refit_worker.contract.rendezvous import (
    BARRIER_KEY,
    PREEMPT_KEY,
    BarrierEntry,
    MetadataEntry,
    PreemptNotice,
    ProgressEntry,
    RefitReport,
    decode_entry,
    encode_entry,
    meta_key,
    progress_key,
)

SPEC: dict[str, Any] = {
    "image": "img",
    "policy": {"replicas": 2},
    "rollout": {"replicas": 1},
    "failurePolicy": {"maxRestarts": 1, "backoffSeconds": 10},
}
POD_NAMES = ["job-policy-0-e0", "job-policy-1-e0", "job-rollout-0-g0"]
POLICY_PODS = POD_NAMES[:2]
JOB = Harness(SPEC)
_pods, _run = JOB.pods, JOB.run


def _status(**kw: Any) -> RefitJobStatus:
    return RefitJobStatus(**kw)


def test_new_job_creates_every_child_and_stays_pending() -> None:
    d = _run(_status(), [], static=False)
    assert _creates(d) == sorted(
        [*POD_NAMES, "job-policy", "job-rollout", "job-signing"]
        + ["job-rendezvous", "job-rendezvous-policy", "job-rendezvous-rollout"]
        + ["job-policy-worker"] * 3
        + ["job-rollout-worker"] * 3
    )
    assert d.status.phase is Phase.PENDING
    assert d.status.created_epoch == 0 and d.status.start_time == NOW
    # Asked for 2 and 1; none exists yet (the creates land after this round).
    assert (d.status.policy.desired, d.status.rollout.desired) == (2, 1)
    assert (d.status.policy.total, d.status.rollout.total) == (0, 0)
    assert _deletes(d) == [] and _events(d) == []


def test_existing_children_are_not_created_again() -> None:
    d = _run(_status(created_epoch=0), _pods(0))
    assert _creates(d) == [] and d.status.phase is Phase.PENDING


def test_all_ready_is_running_with_counts_and_an_event() -> None:
    pods = _pods(0, **dict.fromkeys(POD_NAMES, RUNNING))
    d = _run(_status(created_epoch=0), pods)
    assert d.status.phase is Phase.RUNNING
    assert (d.status.policy.ready, d.status.rollout.ready) == (2, 1)
    assert _events(d) == [("Normal", "Running")]
    ready = next(c for c in d.status.conditions if c.type == "Ready")
    assert (ready.status, ready.last_transition_time) == ("True", NOW)


def test_disruption_target_restarts_the_gang_as_a_preemption() -> None:
    evicted = {
        **RUNNING,
        "conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"},
        ],
    }
    pods = _pods(
        0, **{"job-policy-0-e0": RUNNING, "job-policy-1-e0": evicted, "job-rollout-0-g0": RUNNING}
    )
    data = {"job-rendezvous": {"meta.policy.0": "{}", "barrier": "{}"}}
    d = _run(_status(phase=Phase.RUNNING, created_epoch=0), pods, rendezvous=data)
    s = d.status
    assert (s.phase, s.epoch, s.created_epoch, s.preemptions, s.restarts) == (
        Phase.RESTARTING,
        1,
        None,
        1,
        0,
    )
    assert s.restart_at == NOW + timedelta(seconds=10)
    assert _deletes(d) == POLICY_PODS  # the rollout pod keeps serving
    # The policy gang's notice goes out before the deletes, so ranks stop at a safe point.
    notice = d.actions.index(next(a for a in d.actions if isinstance(a, PatchData)))
    first_delete = d.actions.index(next(a for a in d.actions if isinstance(a, Delete)))
    assert notice < first_delete
    patch = d.actions[notice]
    assert isinstance(patch, PatchData) and patch.name == "job-rendezvous"
    entry = decode_entry(PREEMPT_KEY, str(patch.data[PREEMPT_KEY]))
    assert isinstance(entry, PreemptNotice)
    assert (entry.epoch, entry.pod, entry.uid) == (0, "job-policy-1-e0", "uid-job-policy-1-e0-0")
    assert ("Warning", "Preempted") in _events(d)
    assert "EvictionByEvictionAPI" in s.message


@pytest.mark.parametrize(
    ("pod_status", "meta", "kind"),
    [
        ({"phase": "Failed", "reason": "Evicted"}, {}, "preemption"),
        (RUNNING, {"deletionTimestamp": "2026-01-01T00:00:00Z"}, "preemption"),
        (
            {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {"exitCode": 83}}}]},
            {},
            "preemption",
        ),
        (
            {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {"exitCode": 1}}}]},
            {},
            "failure",
        ),
        ({"phase": "Failed"}, {}, "failure"),
        (SUCCEEDED, {}, None),
        ({"phase": "Pending"}, {}, None),
    ],
)
def test_pod_classification(
    pod_status: dict[str, Any], meta: dict[str, Any], kind: str | None
) -> None:
    pod = {
        "metadata": {"name": "p", "labels": {"refit.dev/epoch": "0"}, **meta},
        "status": pod_status,
    }
    seen = observe_pod(pod)
    assert (seen.disruption is not None, seen.failure is not None) == (
        kind == "preemption",
        kind == "failure",
    )


def test_failure_counts_a_restart_with_doubling_backoff() -> None:
    failed = {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {"exitCode": 3}}}]}
    pods = _pods(
        0, **{"job-policy-0-e0": failed, "job-policy-1-e0": RUNNING, "job-rollout-0-g0": RUNNING}
    )
    d = _run(_status(phase=Phase.RUNNING, created_epoch=0), pods)
    s = d.status
    assert (s.phase, s.epoch, s.restarts, s.preemptions) == (Phase.RESTARTING, 1, 1, 0)
    assert "job-policy-0-e0 failed: exit code 3" in s.message
    assert ("Warning", "Restarted") in _events(d)


def test_failure_past_max_restarts_fails_the_job() -> None:
    pods = _pods(2, **{"job-policy-0-e2": {"phase": "Failed"}})
    d = _run(_status(phase=Phase.RUNNING, epoch=2, created_epoch=2, restarts=1), pods)
    s = d.status
    assert (s.phase, s.restarts, s.epoch) == (Phase.FAILED, 1, 2)
    assert "maxRestarts (1) used up" in s.message
    assert _deletes(d) == ["job-policy-0-e2", "job-policy-1-e2", "job-rollout-0-g0"]
    assert ("Warning", "Failed") in _events(d)
    assert next(c for c in s.conditions if c.type == "Failed").status == "True"


def test_preemptions_do_not_use_up_restarts() -> None:
    pods = _pods(5, **{"job-policy-1-e5": {"phase": "Failed", "reason": "Evicted"}})
    d = _run(
        _status(phase=Phase.RUNNING, epoch=5, created_epoch=5, restarts=1, preemptions=4), pods
    )
    assert (d.status.phase, d.status.preemptions, d.status.restarts) == (Phase.RESTARTING, 5, 1)


def test_new_gang_waits_for_old_pods_then_backoff() -> None:
    # A policy restart: the old policy gang goes, the rollout pod keeps serving.
    restarting = _status(phase=Phase.RESTARTING, epoch=1, restart_at=NOW + timedelta(seconds=10))
    rollout = _pods(0, policy=False)
    d = _run(restarting, _pods(0))  # old epoch still there
    assert _creates(d) == [] and _deletes(d) == POLICY_PODS
    assert d.status.phase is Phase.RESTARTING and d.requeue_after == POLL_DELETING_S
    d = _run(restarting, rollout)  # gone, backoff still running
    assert _creates(d) == [] and d.status.phase is Phase.RESTARTING
    assert d.requeue_after == pytest.approx(10.0)
    d = _run(restarting, rollout, now=NOW + timedelta(seconds=11))
    assert _creates(d) == ["job-policy-0-e1", "job-policy-1-e1"] and d.status.created_epoch == 1
    assert _deletes(d) == []
    assert d.status.phase is Phase.PENDING and d.status.restart_at is None
    labels = {
        a.obj["metadata"]["labels"]["refit.dev/epoch"] for a in d.actions if isinstance(a, Create)
    }
    assert labels == {"1"}


def test_a_vanished_pod_is_a_preemption() -> None:
    pods = [
        p
        for p in _pods(0, **dict.fromkeys(POD_NAMES, RUNNING))
        if p["metadata"]["name"] != "job-policy-1-e0"
    ]
    d = _run(_status(phase=Phase.RUNNING, created_epoch=0), pods)
    assert (d.status.preemptions, d.status.epoch) == (1, 1)
    assert "job-policy-1-e0: PodMissing" in d.status.message


def test_suspend_deletes_pods_and_keeps_the_job() -> None:
    spec = {**SPEC, "suspend": True}
    d = _run(
        _status(phase=Phase.RUNNING, created_epoch=0),
        _pods(0, **dict.fromkeys(POD_NAMES, RUNNING)),
        spec=spec,
    )
    assert d.status.phase is Phase.SUSPENDED and _deletes(d) == POD_NAMES and _creates(d) == []
    assert d.status.epoch == 1 and d.status.created_epoch is None
    resumed = _run(d.status, [])
    # Everything stopped: a new epoch, and the rollout replica's next generation.
    assert resumed.status.phase is Phase.PENDING
    assert _creates(resumed) == ["job-policy-0-e1", "job-policy-1-e1", "job-rollout-0-g1"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({**SPEC, "preemption": {"signal": "SIGNOPE"}}, "Unknown signal name 'SIGNOPE'"),
        ({**SPEC, "transfer": {"bucketSize": "0"}}, "bucketSize '0' must be more than 0 bytes"),
        ({**SPEC, "rollout": {"replicas": 0}}, "spec.rollout.replicas"),
        ({**SPEC, "extra": 1}, "spec.extra: Extra inputs are not permitted"),
    ],
)
def test_invalid_spec_fails_with_a_message_and_creates_nothing(
    spec: dict[str, Any], message: str
) -> None:
    d = _run(_status(), [], spec=spec, static=False)
    assert d.status.phase is Phase.FAILED and message in d.status.message
    assert _creates(d) == []
    assert [(a.type, a.reason) for a in d.actions if isinstance(a, Emit)] == [
        ("Warning", "InvalidSpec")
    ]
    assert message in next(a.message for a in d.actions if isinstance(a, Emit))
    again = _run(d.status, [], spec=spec, static=False)
    assert again.actions == ()  # no second Event for the same problem


def test_too_long_job_name_is_invalid() -> None:
    ref = JobRef(name="j" * 60, namespace="ns", uid="u")
    job = JobView(ref=ref, generation=1, raw_spec=SPEC, status=_status())
    d = reconcile(job, observe([], []), NOW, RenderOptions())
    assert d.status.phase is Phase.FAILED and "too long" in d.status.message


def test_fixed_spec_after_invalid_starts_over() -> None:
    bad = _run(_status(), [], spec={**SPEC, "extra": 1}, static=False)
    fixed = _run(bad.status, [], generation=2, static=False)
    assert fixed.status.phase is Phase.PENDING and "job-policy-0-e1" in _creates(fixed)
    assert next(c for c in fixed.status.conditions if c.type == "Failed").status == "False"


@pytest.mark.parametrize("current", list(Phase), ids=lambda p: p.value)
def test_an_invalid_spec_moves_the_phase_by_the_table(current: Phase) -> None:
    # The invalid path goes through the phase table: Failed from every phase but Succeeded,
    # which the table keeps final.
    status = _status(phase=current, created_epoch=0, observed_generation=1)
    pods = _pods(0, **dict.fromkeys(POD_NAMES, RUNNING))
    d = _run(status, pods, spec={**SPEC, "extra": 1}, generation=2)
    assert d.status.phase is next_phase(PhaseFacts(current=current, invalid=True))
    assert d.status.observed_generation == 2
    if current is Phase.SUCCEEDED:
        assert d.actions == ()
        assert d.status.message == ""
    else:
        assert d.status.phase is Phase.FAILED and "spec.extra" in d.status.message
        assert _deletes(d) == POD_NAMES and ("Warning", "InvalidSpec") in _events(d)


def test_the_retry_after_a_fix_is_a_phase_move_from_failed() -> None:
    bad = _run(_status(), [], spec={**SPEC, "extra": 1}, static=False)
    fixed = _run(bad.status, [], generation=2, static=False)
    assert fixed.status.epoch == bad.status.epoch + 1  # a new epoch: no stale entry counts
    assert ("Normal", "Pending") in _events(fixed)  # Failed -> Pending, announced
    unchanged = _run(bad.status, [], spec={**SPEC, "extra": 1}, static=False)
    assert unchanged.status.phase is Phase.FAILED  # the same generation: no retry


def test_spec_change_recreates_the_gang_without_counting() -> None:
    pods = _pods(0, **dict.fromkeys(POD_NAMES, RUNNING))
    grown = {**SPEC, "image": "img:2"}  # rollout.replicas would be a scale, no spec change
    running = _status(phase=Phase.RUNNING, created_epoch=0, observed_generation=1)
    d = _run(running, pods, spec=grown, generation=2)
    s = d.status
    assert (s.phase, s.epoch, s.restarts, s.preemptions) == (Phase.RESTARTING, 1, 0, 0)
    assert _deletes(d) == POD_NAMES and ("Warning", "SpecChanged") in _events(d)
    assert s.observed_generation == 2
    later = _run(s, [], spec=grown, generation=2, now=NOW + timedelta(seconds=1))
    # Every pod stopped: a new epoch and the rollout replica's next generation.
    assert _creates(later) == ["job-policy-0-e1", "job-policy-1-e1", "job-rollout-0-g1"]


def _meta(role: str, rank: int, epoch: int, uid: str) -> tuple[str, str]:
    key = meta_key(role, rank)  # type: ignore[arg-type]
    entry = MetadataEntry(epoch=epoch, uid=uid, role=role, rank=rank, agent='{"agent": 1}')
    return key, encode_entry(key, entry)


def _published(epoch: int, skip: str = "", uid_of: dict[str, str] | None = None) -> dict[str, str]:
    data = {}
    for name in POD_NAMES:
        if name == skip:
            continue
        _, role, rank, _incarnation = name.split("-")
        uid = (uid_of or {}).get(name, f"uid-{name}-{epoch}")
        key, value = _meta(role, int(rank), epoch, uid)
        data[key] = value
    return data


def test_barrier_opens_once_every_rank_of_the_epoch_published() -> None:
    pods = _pods(0, **dict.fromkeys(POD_NAMES, RUNNING))
    running = _status(phase=Phase.RUNNING, created_epoch=0, observed_generation=1)
    partial = _run(running, pods, rendezvous=spread("job", _published(0, skip="job-rollout-0-g0")))
    assert not [a for a in partial.actions if isinstance(a, PatchData)]
    full = _run(running, pods, rendezvous=spread("job", _published(0)))
    (patch,) = [a for a in full.actions if isinstance(a, PatchData)]
    barrier = decode_entry(BARRIER_KEY, str(patch.data[BARRIER_KEY]))
    assert isinstance(barrier, BarrierEntry) and barrier.epoch == 0
    assert [m.uid if m else None for m in barrier.rollout] == ["uid-job-rollout-0-g0-0"]
    assert barrier.version == 1
    assert barrier.policy_uids == ("uid-job-policy-0-e0-0", "uid-job-policy-1-e0-0")
    # Entries of another epoch do not count.
    old = _run(running, pods, rendezvous=spread("job", _published(7)))
    assert not [a for a in old.actions if isinstance(a, PatchData)]


def test_an_entry_from_another_pod_is_flagged_not_trusted() -> None:
    pods = _pods(0, **dict.fromkeys(POD_NAMES, RUNNING))
    data = _published(0, uid_of={"job-policy-1-e0": "someone-else"})
    d = _run(_status(phase=Phase.RUNNING, created_epoch=0), pods, rendezvous=spread("job", data))
    assert not [a for a in d.actions if isinstance(a, PatchData)]
    flag = next(c for c in d.status.conditions if c.type == "RendezvousReadable")
    assert flag.status == "False" and "someone-else" in flag.message


def test_progress_of_the_rollout_ranks_shows_in_status() -> None:
    pods = _pods(1, **dict.fromkeys(POD_NAMES, RUNNING))
    key = progress_key("rollout", 0)
    entry = ProgressEntry(
        epoch=1,
        uid="uid-job-rollout-0-g0-1",
        role="rollout",
        rank=0,
        refits_completed=2,
        bytes_total=3000,
        seconds_total=1.5,
        recent=(RefitReport(refit=1, bytes=1000, seconds=0.5),),
    )
    data = {key: encode_entry(key, entry)}
    # A pod of an earlier epoch, gone with its report: its bytes stay counted.
    earlier = [PodBytes(uid="uid-job-rollout-0-g0-0", bytes=500)]
    st = _status(
        phase=Phase.RUNNING,
        epoch=1,
        created_epoch=1,
        refits_completed=1,
        bytes_counted=earlier,
        bytes_transferred=500,
    )
    d = _run(st, pods, rendezvous=spread("job", data))
    assert d.status.refits_completed == 2
    assert d.status.bytes_transferred == 3500
    assert d.status.bytes_counted == [*earlier, PodBytes(uid=entry.uid, bytes=3000)]
    assert d.status.last_throughput_bytes_per_second == pytest.approx(2000.0)


def test_stale_entries_are_cleared_before_the_new_gang_starts() -> None:
    waiting = _status(phase=Phase.RESTARTING, epoch=1, refits_completed=2)
    data = {"job-rendezvous": _published(0)}
    d = _run(waiting, [], rendezvous=data)
    (patch,) = [a for a in d.actions if isinstance(a, PatchData)]
    assert patch.data == dict.fromkeys(sorted(data["job-rendezvous"]))
    assert _creates(d) == [] and d.requeue_after == POLL_DELETING_S
    clean = _run(waiting, [], rendezvous={"job-rendezvous": {}})
    assert _creates(clean) == ["job-policy-0-e1", "job-policy-1-e1", "job-rollout-0-g0"]
    pod = next(a.obj for a in clean.actions if isinstance(a, Create))
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["REFIT_FIRST_REFIT"] == "2"  # the new gang resumes after the refits done


def test_pods_of_an_older_spec_are_never_adopted() -> None:
    # The status write after creating the gang was lost, then the spec changed.
    grown = {**SPEC, "image": "img:2"}
    d = _run(_status(), _pods(0), spec=grown, generation=2)
    assert (d.status.epoch, d.status.restarts, d.status.preemptions) == (1, 0, 0)
    assert _creates(d) == []  # no pod of the new spec while old ones stand
    assert _deletes(d) == POD_NAMES and ("Warning", "SpecChanged") in _events(d)
