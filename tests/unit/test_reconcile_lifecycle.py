"""The pure reconcile on a platform: gang gates, suspend, managedBy, deadlines, TTL, the
Restarting condition, conditions as ``metav1.Condition``, and the apiserver's refusals
(``after_writes``).  Pods are manifests as the API returns them, read by ``observe``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from tests.support.reconcile_harness import NOW, REF, RUNNING, Harness
from tests.support.reconcile_harness import condition as _condition
from tests.support.reconcile_harness import of as _of

from refit_operator.api.models import Phase, RefitJobStatus, RolloutReplica
from refit_operator.core.coordinate import PatchData
from refit_operator.core.decision import (
    Create,
    Decision,
    Delete,
    DeleteJob,
    Emit,
    JobView,
    LiftGate,
)
from refit_operator.core.observe import observe, observe_pod
from refit_operator.core.reconcile import reconcile
from refit_operator.core.write_refusals import RETRY_WRITE_S, after_writes
from refit_operator.core.writes import WriteError
from refit_operator.render.pods import RenderOptions

SPEC: dict[str, Any] = {
    "image": "img",
    "policy": {"replicas": 2},
    "rollout": {"replicas": 1},
    "failurePolicy": {"maxRestarts": 0, "backoffSeconds": 10},
}
NAMES = ["job-policy-0-e0", "job-policy-1-e0", "job-rollout-0-g0"]
JOB = Harness(SPEC, generation=3)
_pods, _run = JOB.pods, JOB.run


# -- gang admission ------------------------------------------------------------------------


def test_the_gate_comes_off_every_pod_together_once_all_exist() -> None:
    made = RefitJobStatus(created_epoch=0, epoch_start_time=NOW)
    created = made.model_copy(
        update={"rollout_replicas": [RolloutReplica(rank=0, pod="job-rollout-0-g0")]}
    )
    partial = _pods(0)[:2]
    d = _run(created, partial)  # one pod went missing before release: a preemption
    assert _of(d, LiftGate) == []
    # The status write that recorded the creates was lost: the rest is created, no gate off.
    d = _run(made.model_copy(update={"created_epoch": None}), partial)
    assert _of(d, LiftGate) == []
    assert sorted(c.obj["metadata"]["name"] for c in _of(d, Create)) == NAMES[2:]
    d = _run(created, _pods(0))
    lifts = _of(d, LiftGate)
    assert sorted(a.name for a in lifts) == NAMES
    assert all(a.gates == () and a.resource_version == "41" for a in lifts)
    assert d.status.phase is Phase.PENDING


def test_a_gate_of_someone_elses_is_kept() -> None:
    pods = _pods(0)
    for pod in pods:
        pod["spec"]["schedulingGates"].insert(0, {"name": "example.com/quota"})
    d = _run(RefitJobStatus(created_epoch=0, epoch_start_time=NOW), pods)
    assert {a.gates for a in _of(d, LiftGate)} == {("example.com/quota",)}


def test_no_gates_without_scheduling_gate_admission() -> None:
    spec = {**SPEC, "gang": {"admission": "None"}}
    pods = _pods(0, spec)
    assert all("schedulingGates" not in p["spec"] for p in pods)
    assert _of(_run(RefitJobStatus(created_epoch=0), pods, spec=spec), LiftGate) == []


def test_partly_created_gang_keeps_its_rendezvous_entries() -> None:
    # A create failed last round: the pods that exist are this epoch's, their entries too.
    status = RefitJobStatus(epoch=1, epoch_start_time=NOW)
    job = JobView(ref=REF, generation=1, raw_spec=SPEC, status=status)
    data = {"job-rendezvous": {"meta.policy.0": "{}"}}
    d = reconcile(job, observe(_pods(1)[:1], [], data), NOW, RenderOptions())
    assert not [a for a in d.actions if isinstance(a, PatchData)]
    assert len(_of(d, Create)) > 0


# -- suspend and managedBy -----------------------------------------------------------------


def test_a_suspended_new_job_creates_nothing() -> None:
    d = _run(RefitJobStatus(), [], spec={**SPEC, "suspend": True}, static=False)
    assert _of(d, Create) == [] and d.status.phase is Phase.SUSPENDED
    assert _condition(d.status, "Suspended").status == "True"
    resumed = _run(d.status, [], static=False)
    made = [c for c in _of(resumed, Create) if c.obj["kind"] != "Secret"]
    assert len(made) == 6 + 2 + 3 + 3  # RBAC per role, Services, maps, pods


def test_a_job_managed_elsewhere_is_left_alone() -> None:
    spec = {**SPEC, "managedBy": "kueue.x-k8s.io/multikueue"}
    status = RefitJobStatus(phase=Phase.RUNNING, message="theirs")
    d = _run(status, _pods(0), spec=spec)
    assert d.hands_off and d.actions == () and d.status == status
    mine = _run(RefitJobStatus(), [], spec={**SPEC, "managedBy": "refit.dev/refit-operator"})
    assert not mine.hands_off and _of(mine, Create)


# -- deadlines and TTL ---------------------------------------------------------------------


def test_start_deadline_fails_the_epoch_with_each_pods_reason() -> None:
    spec = {**SPEC, "startDeadlineSeconds": 30}
    pulling = {
        "phase": "Pending",
        "containerStatuses": [
            {
                "state": {
                    "waiting": {
                        "reason": "ImagePullBackOff",
                        "message": 'Back-off pulling image "x.invalid/i"',
                    }
                }
            }
        ],
    }
    unplaced = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
            }
        ],
    }
    pods = _pods(0, spec, **{"job-policy-0-e0": pulling, "job-rollout-0-g0": unplaced})
    pods[1]["status"] = RUNNING
    started = RefitJobStatus(phase=Phase.PENDING, created_epoch=0, epoch_start_time=NOW)
    early = _run(started, pods, spec=spec, now=NOW + timedelta(seconds=29))
    assert early.status.phase is Phase.PENDING and early.requeue_after == pytest.approx(1.0)
    assert "job-policy-0-e0: ImagePullBackOff" in early.status.message  # what it waits for
    late = _run(started, pods, spec=spec, now=NOW + timedelta(seconds=31))
    assert late.status.phase is Phase.FAILED
    message = late.status.message
    assert message.startswith("epoch 0 did not start within startDeadlineSeconds (30 s): ")
    assert 'job-policy-0-e0: ImagePullBackOff: Back-off pulling image "x.invalid/i"' in message
    assert "job-rollout-0-g0: Unschedulable: 0/2 nodes are available" in message
    assert "job-policy-1-e0" not in message  # it was Ready
    assert _condition(late.status, "Failed").reason == "StartDeadlineExceeded"
    assert sorted(a.name for a in _of(late, Delete)) == NAMES


def test_a_gang_that_was_ready_once_has_no_start_deadline() -> None:
    spec = {**SPEC, "startDeadlineSeconds": 30}
    ready = RefitJobStatus(
        phase=Phase.RUNNING, created_epoch=0, epoch_start_time=NOW, ready_epoch=0
    )
    pods = _pods(0, spec, **dict.fromkeys(NAMES, RUNNING))
    pods[0]["status"] = {"phase": "Pending"}
    d = _run(ready, pods, spec=spec, now=NOW + timedelta(hours=1))
    assert d.status.phase is Phase.PENDING


def test_active_deadline_fails_the_job() -> None:
    spec = {**SPEC, "activeDeadlineSeconds": 60}
    status = RefitJobStatus(phase=Phase.RUNNING, created_epoch=0, start_time=NOW)
    pods = _pods(0, spec, **dict.fromkeys(NAMES, RUNNING))
    before = _run(status, pods, spec=spec, now=NOW + timedelta(seconds=50))
    assert before.status.phase is Phase.RUNNING
    assert before.requeue_after == pytest.approx(10.0)
    after = _run(status, pods, spec=spec, now=NOW + timedelta(seconds=61))
    assert after.status.phase is Phase.FAILED
    assert after.status.message == "the job ran past activeDeadlineSeconds (60 s)"
    assert _condition(after.status, "Failed").reason == "DeadlineExceeded"
    assert sorted(a.name for a in _of(after, Delete)) == NAMES


def test_a_suspend_restarts_the_active_deadline() -> None:
    spec = {**SPEC, "activeDeadlineSeconds": 60, "suspend": True}
    status = RefitJobStatus(phase=Phase.RUNNING, created_epoch=0, start_time=NOW)
    d = _run(status, [], spec=spec, now=NOW + timedelta(seconds=59))
    assert d.status.start_time is None and d.status.phase is Phase.SUSPENDED


@pytest.mark.parametrize("phase", [Phase.SUCCEEDED, Phase.FAILED])
def test_ttl_after_finished_deletes_the_job(phase: Phase) -> None:
    spec = {**SPEC, "ttlSecondsAfterFinished": 5}
    done = RefitJobStatus(phase=phase, completion_time=NOW)
    soon = _run(done, [], spec=spec, now=NOW + timedelta(seconds=2))
    assert _of(soon, DeleteJob) == [] and soon.requeue_after == pytest.approx(3.0)
    due = _run(done, [], spec=spec, now=NOW + timedelta(seconds=5))
    assert len(_of(due, DeleteJob)) == 1
    forever = _run(done, [], now=NOW + timedelta(days=9))
    assert _of(forever, DeleteJob) == []


def test_ttl_applies_to_a_job_refused_as_invalid() -> None:
    spec = {**SPEC, "ttlSecondsAfterFinished": 0, "policy": {"replicas": 0}}
    d = _run(RefitJobStatus(), [], spec=spec, static=False)
    assert d.status.phase is Phase.FAILED and d.status.completion_time == NOW
    assert len(_of(d, DeleteJob)) == 1


# -- conditions ----------------------------------------------------------------------------


def test_restarting_is_set_while_a_gang_is_recreated_then_cleared() -> None:
    spec = {**SPEC, "failurePolicy": {"maxRestarts": 3, "backoffSeconds": 1}}
    failed = {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {"exitCode": 1}}}]}
    pods = _pods(0, spec, **{"job-policy-0-e0": failed})
    d = _run(RefitJobStatus(phase=Phase.RUNNING, created_epoch=0), pods, spec=spec)
    restarting = _condition(d.status, "Restarting")
    assert (d.status.phase, restarting.status, restarting.reason) == (
        Phase.RESTARTING,
        "True",
        "Restarted",
    )
    assert "job-policy-0-e0 failed" in restarting.message
    later = _run(d.status, [], spec=spec, now=NOW + timedelta(seconds=2))
    assert later.status.phase is Phase.PENDING
    assert _condition(later.status, "Restarting").status == "False"


def test_every_condition_has_a_reason_and_the_generation_it_saw() -> None:
    d = _run(RefitJobStatus(created_epoch=0), _pods(0, **dict.fromkeys(NAMES, RUNNING)))
    assert {c.type for c in d.status.conditions} >= {"Ready", "Suspended", "Restarting"}
    for c in d.status.conditions:
        assert c.reason and c.observed_generation == 3, c
    dumped = d.status.model_dump(mode="json", by_alias=True)["conditions"][0]
    assert set(dumped) >= {"type", "status", "reason", "message", "lastTransitionTime"}
    assert "observedGeneration" in dumped


# -- what the apiserver refused ------------------------------------------------------------


def _refused(status: int, reason: str, kind: str = "Pod", verb: str = "create") -> WriteError:
    text = f'pods "job-rollout-0-g0" is forbidden: {reason.lower()} says no'
    return WriteError(verb, kind, "job-rollout-0-g0", status, reason, text)


def _after(decision: Decision, errors: list[WriteError], status: RefitJobStatus) -> Any:
    job = JobView(ref=REF, generation=3, raw_spec=SPEC, status=status)
    return after_writes(job, observe([], []), decision, errors, NOW)


def test_a_refused_create_is_said_in_status_condition_and_event_then_retried() -> None:
    first = _run(RefitJobStatus(), [], static=False)
    assert first.status.created_epoch == 0
    d = _after(first, [_refused(403, "Forbidden")], RefitJobStatus())
    failure = _condition(d.status, "ChildFailure")
    assert (failure.status, failure.reason) == ("True", "Forbidden")
    text = (
        "create Pod job-rollout-0-g0: HTTP 403: "
        'pods "job-rollout-0-g0" is forbidden: forbidden says no'
    )
    assert failure.message == text and d.status.message == text
    assert [(e.type, e.reason, e.message) for e in _of(d, Emit)] == [
        ("Warning", "FailedCreate", text)
    ]
    assert d.status.created_epoch is None  # the next round creates what is missing
    assert d.requeue_after == pytest.approx(RETRY_WRITE_S)
    assert _of(d, Create) == []  # the creates were done; only what follows remains
    # The next round starts from the status written: the same refusal, no second Event.
    second = _run(d.status, _pods(0)[:2], static=False)
    again = _after(second, [_refused(403, "Forbidden")], d.status)
    assert _of(again, Emit) == [] and _condition(again.status, "ChildFailure").status == "True"
    fixed = _after(second, [], d.status)
    assert _condition(fixed.status, "ChildFailure").status == "False"
    assert fixed.status.created_epoch == 0


def test_a_create_refused_for_good_fails_the_job_until_the_spec_changes() -> None:
    first = _run(RefitJobStatus(), [], static=False)
    d = _after(first, [_refused(422, "Invalid")], RefitJobStatus())
    assert d.status.phase is Phase.FAILED
    assert _condition(d.status, "Failed").reason == "ChildRejected"
    assert (
        "the apiserver refused a child: create Pod job-rollout-0-g0: HTTP 422" in d.status.message
    )
    assert ("Warning", "ChildRejected") in [(e.type, e.reason) for e in _of(d, Emit)]
    stays = _run(d.status, [], generation=3)
    assert stays.status.phase is Phase.FAILED and _of(stays, Create) == []
    retried = _run(d.status, [], generation=4)
    assert retried.status.phase is Phase.PENDING and _of(retried, Create)


def test_a_refused_delete_of_a_finished_job_keeps_its_message() -> None:
    done = RefitJobStatus(phase=Phase.FAILED, message="maxRestarts used up")
    decision = Decision((), done)
    d = _after(decision, [_refused(403, "Forbidden", verb="delete")], done)
    assert d.status.message == "maxRestarts used up"
    assert _condition(d.status, "ChildFailure").status == "True"


# -- what a pod waits for --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "spec", "waiting"),
    [
        (
            {"containerStatuses": [{"state": {"waiting": {"reason": "ErrImagePull"}}}]},
            {},
            "ErrImagePull",
        ),
        (
            {
                "initContainerStatuses": [
                    {
                        "state": {
                            "waiting": {"reason": "CreateContainerConfigError", "message": "no"}
                        }
                    }
                ]
            },
            {},
            "CreateContainerConfigError: no",
        ),
        (
            {
                "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
                ]
            },
            {},
            "Unschedulable",
        ),
        ({}, {"schedulingGates": [{"name": "refit.dev/gang"}]}, "SchedulingGated: refit.dev/gang"),
        ({}, {}, None),
    ],
)
def test_observe_says_what_a_pending_pod_waits_for(
    status: dict[str, Any], spec: dict[str, Any], waiting: str | None
) -> None:
    pod = {"metadata": {"name": "p"}, "spec": spec, "status": {"phase": "Pending", **status}}
    assert observe_pod(pod).waiting == waiting
