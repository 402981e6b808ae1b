"""The failure policy of the pure reconcile: how a failed pod is named (a signal death as
such, an OOM kill as OOMKilled, an exit of its own with its termination message), and a
failure the worker marks as not retryable (``refit_worker.contract.exits.NOT_RETRYABLE``)
failing the job at once instead of spending ``maxRestarts``.

Pods are manifests as the API returns them, read by ``observe``; nothing is emulated.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.support.reconcile_harness import NOW, RUNNING, Harness, condition, events, of

from refit_operator.api.models import Phase, RefitJobStatus
from refit_operator.core.decision import Create, Delete, Emit
from refit_operator.core.observe import observe_pod
from refit_worker.contract.exits import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_NOT_RETRYABLE

SPEC: dict[str, Any] = {
    "image": "img",
    "policy": {"replicas": 1},
    "rollout": {"replicas": 1},
    "failurePolicy": {"maxRestarts": 3, "backoffSeconds": 10},
}
JOB = Harness(SPEC)
#: The tail of the log a kubelet quotes as the message of a container killed mid-line.
LOG_LINE = "2026-12-01 04:25:53,171 refit_worker INFO policy rank 0: refit 17 sent"


def _failed(code: int, *, reason: str = "Error", message: str = "", **extra: Any) -> Any:
    terminated = {"exitCode": code, "reason": reason, **extra}
    if message:
        terminated["message"] = message
    return {"phase": "Failed", "containerStatuses": [{"state": {"terminated": terminated}}]}


def _pod(status: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "p", "labels": {}}, "status": status}


@pytest.mark.parametrize(
    ("status", "said"),
    [
        (_failed(137, message=LOG_LINE), "pod p failed: killed by SIGKILL (exit code 137)"),
        (_failed(143, message=LOG_LINE), "pod p failed: killed by SIGTERM (exit code 143)"),
        (_failed(134, message=LOG_LINE), "pod p failed: killed by SIGABRT (exit code 134)"),
        (
            _failed(137, reason="OOMKilled", message=LOG_LINE),
            "pod p failed: OOMKilled (exit code 137)",
        ),
        # The CRI's signal field, where a runtime fills it, names the signal too.
        (_failed(1, signal=9), "pod p failed: killed by SIGKILL (exit code 1)"),
        (
            _failed(1, message="Traceback...\nValueError: bad dtype"),
            "pod p failed: exit code 1: ValueError: bad dtype",
        ),
        (_failed(3), "pod p failed: exit code 3"),
    ],
    ids=["sigkill", "sigterm", "sigabrt", "oomkilled", "signal-field", "own-exit", "bare"],
)
def test_a_failed_pod_is_named_as_the_kubelet_reports_it(status: dict[str, Any], said: str) -> None:
    assert observe_pod(_pod(status)).failure == said


def test_a_sigkilled_rank_restarts_the_gang_with_the_signal_named_and_no_log_line() -> None:
    pods = JOB.pods(
        0, **{"job-policy-0-e0": _failed(137, message=LOG_LINE), "job-rollout-0-g0": RUNNING}
    )
    d = JOB.run(RefitJobStatus(created_epoch=0), pods)
    text = "policy gang restart 1: pod job-policy-0-e0 failed: killed by SIGKILL (exit code 137)"
    assert d.status.phase is Phase.RESTARTING and d.status.message == text
    first = of(d, Emit)[0]
    assert (first.type, first.reason, first.message) == ("Warning", "Restarted", text)
    assert "refit_worker INFO" not in d.status.message


@pytest.mark.parametrize("code", [EXIT_NOT_RETRYABLE, EXIT_BAD_CONFIG])
def test_a_not_retryable_exit_fails_the_job_at_once(code: int) -> None:
    why = "refit-worker: dtype float8_e4m3fn is not supported by the NIXL engine"
    pods = JOB.pods(
        0, **{"job-rollout-0-g0": _failed(code, message=why), "job-policy-0-e0": RUNNING}
    )
    d = JOB.run(RefitJobStatus(created_epoch=0, phase=Phase.RUNNING), pods)
    assert d.status.phase is Phase.FAILED
    assert d.status.restarts == 0 and d.status.restart_at is None
    assert d.status.epoch == 0 and d.status.completion_time == NOW
    assert f"pod job-rollout-0-g0 failed: exit code {code}: {why}" in d.status.message
    assert "not retryable" in d.status.message
    failed = condition(d.status, "Failed")
    assert (failed.status, failed.reason) == ("True", "NotRetryable")
    assert failed.message == d.status.message
    assert sorted(a.name for a in of(d, Delete)) == ["job-policy-0-e0", "job-rollout-0-g0"]
    assert of(d, Create) == []
    assert ("Warning", "Failed") in events(d) and ("Warning", "Restarted") not in events(d)
    # Final: the next round creates nothing and counts nothing.
    again = JOB.run(d.status, [])
    assert again.status.phase is Phase.FAILED and of(again, Create) == []
    assert again.status.restarts == 0


def test_a_retryable_exit_still_restarts_with_backoff() -> None:
    # A policy rank's: the policy gang restarts (a rollout rank's is replaced alone).
    pods = JOB.pods(0, **{"job-policy-0-e0": _failed(EXIT_FAILED), "job-rollout-0-g0": RUNNING})
    d = JOB.run(RefitJobStatus(created_epoch=0, phase=Phase.RUNNING), pods)
    assert d.status.phase is Phase.RESTARTING and d.status.restarts == 1
    assert d.requeue_after == 10.0
