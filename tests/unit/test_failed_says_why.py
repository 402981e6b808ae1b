"""Every Failed says why (#29): each way the pure reconcile fails a job leaves
``status.message`` and the ``Failed`` condition naming the cause (the pod, its exit code,
the limit used up), also when no step said why and when a stored Failed status lost its
words.

Pods are manifests as the API returns them, read by ``observe``; nothing is emulated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from tests.support.reconcile_harness import (
    NOW,
    REF,
    RUNNING,
    SUCCEEDED,
    Harness,
    condition,
    exited,
    of,
)

from refit_operator.api.models import Condition, Phase, RefitJobStatus, RolloutReplica
from refit_operator.core import conditions as cond
from refit_operator.core.decision import Create, Decision, Emit, JobView
from refit_operator.core.failure import Failure
from refit_operator.core.observe import Observed
from refit_operator.core.refusal import failed_status
from refit_operator.core.steps import time_limits
from refit_operator.core.write_refusals import after_writes
from refit_operator.core.writes import WriteError

SPEC: dict[str, Any] = {
    "image": "img",
    "policy": {"replicas": 1},
    "rollout": {"replicas": 1, "failurePolicy": {"maxReplacements": 2}},
    "failurePolicy": {"maxRestarts": 2, "backoffSeconds": 10},
}
JOB = Harness(SPEC)
POLICY, ROLLOUT = "job-policy-0-e0", "job-rollout-0-g0"
EVICTION = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}


def _status(**kw: Any) -> RefitJobStatus:
    """A job whose epoch-0 gang was created and ran once, its rollout slot recorded."""
    base: dict[str, Any] = {
        "phase": Phase.RUNNING,
        "created_epoch": 0,
        "ready_epoch": 0,
        "epoch_start_time": NOW - timedelta(minutes=5),
        "start_time": NOW - timedelta(minutes=5),
        "rollout_replicas": [RolloutReplica(rank=0, pod=ROLLOUT)],
    }
    return RefitJobStatus(**{**base, **kw})


def _stored_failed(message: str, condition_message: str) -> RefitJobStatus:
    failed = Condition(
        type=cond.FAILED,
        status="True",
        reason="RestartsExhausted",
        message=condition_message,
        last_transition_time=NOW - timedelta(minutes=1),
    )
    return _status(phase=Phase.FAILED, message=message, restarts=2, conditions=[failed])


@dataclass(frozen=True)
class Case:
    """One way into Failed: the round's input, the Failed condition's reason, and the
    words (pod name, exit code, limit) its message must hold."""

    status: RefitJobStatus
    pods: dict[str, Any]
    reason: str
    says: tuple[str, ...]
    spec: dict[str, Any] = field(default_factory=dict)


CASES = {
    "restarts exhausted": Case(
        _status(restarts=2),
        {POLICY: exited(1, "RuntimeError: gloo connection reset"), ROLLOUT: RUNNING},
        "RestartsExhausted",
        (POLICY, "exit code 1", "gloo connection reset", "maxRestarts (2) used up"),
    ),
    "a gang that fell short, restarts exhausted": Case(
        _status(restarts=2),
        {POLICY: SUCCEEDED, ROLLOUT: SUCCEEDED},
        "RestartsExhausted",
        ("reported 0 of 3 refits", "maxRestarts (2) used up"),
    ),
    "preemptions exhausted": Case(
        _status(preemptions=2),
        {
            POLICY: exited(83, conditions=(EVICTION,)),
            ROLLOUT: RUNNING,
        },
        "PreemptionsExhausted",
        (POLICY, "EvictionByEvictionAPI", "preempted 2 times", "maxPreemptions (2) used up"),
        spec={"failurePolicy": {"maxRestarts": 2, "backoffSeconds": 10, "maxPreemptions": 2}},
    ),
    "replacements exhausted": Case(
        _status(rollout_failures=2),
        {POLICY: RUNNING, ROLLOUT: exited(1)},
        "ReplacementsExhausted",
        (ROLLOUT, "exit code 1", "maxReplacements (2) used up"),
    ),
    "not retryable": Case(
        _status(),
        {POLICY: exited(84, "unsupported dtype float8"), ROLLOUT: RUNNING},
        "NotRetryable",
        (POLICY, "exit code 84", "unsupported dtype float8", "not retryable"),
    ),
    "active deadline": Case(
        _status(),
        {POLICY: RUNNING, ROLLOUT: RUNNING},
        "DeadlineExceeded",
        ("activeDeadlineSeconds (60 s)",),
        spec={"activeDeadlineSeconds": 60},
    ),
    "start deadline, restarts exhausted": Case(
        _status(ready_epoch=None, restarts=2, epoch_start_time=NOW - timedelta(seconds=31)),
        {POLICY: {"phase": "Pending"}, ROLLOUT: RUNNING},
        "StartDeadlineExceeded",
        (POLICY, "startDeadlineSeconds (30 s)", "maxRestarts (2) used up"),
        spec={"startDeadlineSeconds": 30},
    ),
    "invalid spec": Case(
        _status(),
        {},
        "InvalidSpec",
        ("bucketSize '0' must be more than 0 bytes",),
        spec={"transfer": {"bucketSize": "0"}},
    ),
    # Issue #50: a spec the CRD refuses, stored anyway (under an older CRD), fails the job
    # at once naming the field.
    "invalid spec: a bucket no rank can allocate": Case(
        _status(),
        {},
        "InvalidSpec",
        ("spec.transfer.bucketSize", "'1Ti' is 1099511627776 bytes, more than the largest"),
        spec={"transfer": {"bucketSize": "1Ti"}},
    ),
    "invalid spec: a bucket smaller than one element": Case(
        _status(),
        {},
        "InvalidSpec",
        ("spec.transfer.bucketSize", "bucketSize 1 is less than one element"),
        spec={"transfer": {"bucketSize": 1}},
    ),
    "invalid spec: a timeout no clock holds": Case(
        _status(),
        {},
        "InvalidSpec",
        ("spec.transfer.timeoutSeconds", "less than or equal to 86400 (got 1e+308)"),
        spec={"transfer": {"timeoutSeconds": 1e308}},
    ),
    "invalid spec: more layers than the generator can list": Case(
        _status(),
        {},
        "InvalidSpec",
        ("spec.weights.synthetic.layers", "less than or equal to 4096 (got 1000000000000)"),
        spec={"weights": {"synthetic": {"layers": 10**12}}},
    ),
    # A round of a Failed job after one whose status.message was lost: the Failed
    # condition still says why, and the message says it again.
    "stored Failed, message lost": Case(
        _stored_failed("", f"pod {POLICY} failed: exit code 1; maxRestarts (2) used up"),
        {POLICY: exited(1)},
        "RestartsExhausted",
        (POLICY, "exit code 1", "maxRestarts (2) used up"),
    ),
    # Neither says anything (written by an older operator, or by hand): the pods do.
    "stored Failed, no words anywhere": Case(
        _stored_failed("", ""),
        {POLICY: exited(1)},
        "RestartsExhausted",
        (POLICY, "exit code 1", "restarts 2/2 used"),
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_every_failed_names_its_cause_in_message_and_condition(case: Case) -> None:
    spec = {**SPEC, **case.spec}
    pods = JOB.pods(0, **case.pods) if case.pods else []
    _assert_says(JOB.run(case.status, pods, spec=spec), case.reason, case.says)


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("invalid spec")])
def test_a_new_job_with_an_invalid_spec_creates_nothing_and_says_why(name: str) -> None:
    case = CASES[name]
    d = JOB.run(RefitJobStatus(), [], spec={**SPEC, **case.spec})
    _assert_says(d, case.reason, case.says)
    assert of(d, Create) == []
    (event,) = [e for e in of(d, Emit) if e.reason == "InvalidSpec"]
    assert event.type == "Warning" and all(words in event.message for words in case.says)


def _assert_says(d: Decision, reason: str, says: tuple[str, ...]) -> None:
    s = d.status
    assert s.phase is Phase.FAILED
    failed = condition(s, cond.FAILED)
    assert (failed.status, failed.reason) == ("True", reason)
    assert s.message and failed.message == s.message
    for words in says:
        assert words in s.message, (words, s.message)


def test_a_step_that_fails_the_job_without_words_still_leaves_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The guarantee is the round's end, not each step's care: a failing finding with no
    message (a step that forgot) is said from the round's facts."""
    monkeypatch.setattr(time_limits, "active_deadline", lambda inp, draft: "deadline_exceeded")
    pods = JOB.pods(0, **{POLICY: exited(3), ROLLOUT: RUNNING})
    d = JOB.run(_status(restarts=1), pods)
    _assert_says(d, "FailureUnrecorded", (POLICY, "exit code 3", "restarts 1/2 used"))
    (event,) = [e for e in of(d, Emit) if e.reason == "Failed"]
    assert POLICY in event.message


def test_a_restart_message_of_an_earlier_round_is_not_taken_for_the_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    earlier = f"policy gang preempted (1): {POLICY}: DisruptionTarget: EvictionByEvictionAPI"
    monkeypatch.setattr(time_limits, "active_deadline", lambda inp, draft: "deadline_exceeded")
    d = JOB.run(_status(phase=Phase.RESTARTING, message=earlier), [])
    assert d.status.phase is Phase.FAILED
    assert "preempted" not in d.status.message
    assert "restarts 0/2 used, rollout replacements 0/2 used" in d.status.message


def test_a_child_refused_for_good_fails_the_job_with_the_apiservers_words() -> None:
    job = JOB.run(_status(), JOB.pods(0, **{POLICY: RUNNING, ROLLOUT: RUNNING}))
    refused = WriteError("create", "Pod", ROLLOUT, 422, "Invalid", "spec.containers: Required")
    view = JobView(ref=REF, generation=1, raw_spec=SPEC, status=job.status)
    d = after_writes(view, Observed(), job, [refused], NOW)
    _assert_says(d, "ChildRejected", (ROLLOUT, "HTTP 422", "spec.containers: Required"))


def test_a_job_failed_outside_a_round_is_said_as_every_failed() -> None:
    """`refit run` fails a job whose pod cannot start with `refusal.failed_status`."""
    failure = Failure("StartError", f"a pod could not start: pod {POLICY}: no command")
    status = failed_status(_status(), failure, generation=1, now=NOW)
    assert status.phase is Phase.FAILED and f"pod {POLICY}: no command" in status.message
    failed = next(c for c in status.conditions if c.type == cond.FAILED)
    assert (failed.reason, failed.message) == ("StartError", status.message)
    assert status.completion_time is not None


def test_a_preemption_under_the_bound_restarts_the_gang_and_counts_it() -> None:
    spec = {**SPEC, "failurePolicy": {**SPEC["failurePolicy"], "maxPreemptions": 2}}
    pods = JOB.pods(0, **{POLICY: exited(83, conditions=(EVICTION,)), ROLLOUT: RUNNING})
    d = JOB.run(_status(preemptions=1), pods, spec=spec)
    assert (d.status.phase, d.status.preemptions, d.status.restarts) == (
        Phase.RESTARTING,
        2,
        0,
    )
