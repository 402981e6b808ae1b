"""A drain is never a failure (#29): on a loaded node the operator's round can see a
drained policy rank and the peer whose collective broke with it (exit 1, before the
preemption notice reached it) at once; the gang's stop is then a preemption, and a
rollout replica whose transfer broke with its sender is replaced without counting.

Pods are manifests as the API returns them, read by ``observe``; nothing is emulated.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.support.reconcile_harness import (
    GONE,
    RUNNING,
    Harness,
    condition,
    events,
    exited,
    of,
)

from refit_operator.api.models import Phase, RefitJobStatus, RolloutReplica
from refit_operator.core.coordinate import PatchData
from refit_operator.core.observe import observe_pod
from refit_worker.contract.rendezvous import PREEMPT_KEY

SPEC: dict[str, Any] = {
    "image": "img",
    "policy": {"replicas": 2},
    "rollout": {"replicas": 1, "failurePolicy": {"maxReplacements": 0}},
    # No restart left: a drain counted as a failure would fail the job here.
    "failurePolicy": {"maxRestarts": 0, "backoffSeconds": 10},
}
JOB = Harness(SPEC)
P0, P1, ROLLOUT = "job-policy-0-e0", "job-policy-1-e0", "job-rollout-0-g0"
DELETING = {"deletionTimestamp": "2026-01-01T11:59:50Z"}
EVICTION = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}


BROKEN = exited(1, "RuntimeError: Connection closed by peer")
#: The drained rank as the round may find it: still stopping, stopped at a safe point (83),
#: killed by its stop signal before its handler was in place (143), or already gone.
DRAINED: dict[str, Any] = {
    "stopping": {**RUNNING, "conditions": [{"type": "Ready", "status": "True"}, EVICTION]},
    "exit 83": exited(83, conditions=(EVICTION,)),
    "exit 143": exited(143, conditions=(EVICTION,)),
    "gone": GONE,
}


def _running() -> RefitJobStatus:
    slots = [RolloutReplica(rank=0, pod=ROLLOUT)]
    return RefitJobStatus(
        phase=Phase.RUNNING, created_epoch=0, ready_epoch=0, rollout_replicas=slots
    )


def _pods(drained: Any, rollout: dict[str, Any]) -> list[dict[str, Any]]:
    pods = JOB.pods(0, **{P0: drained, P1: BROKEN, ROLLOUT: rollout})
    for pod in pods:
        if pod["metadata"]["name"] == P0:
            pod["metadata"].update(DELETING)  # the eviction deletes it with its grace period
    return pods


@pytest.mark.parametrize("drained", DRAINED.values(), ids=DRAINED.keys())
def test_a_peer_failing_with_a_drained_rank_is_a_preemption(drained: Any) -> None:
    d = JOB.run(_running(), _pods(drained, RUNNING))
    s = d.status
    assert (s.phase, s.restarts, s.preemptions, s.epoch) == (Phase.RESTARTING, 0, 1, 1)
    assert P0 in s.message and "preempted" in s.message
    assert condition(s, "Restarting").reason == "Preempted"
    assert ("Warning", "Preempted") in events(d)
    if drained is not GONE:  # the ranks still running hear the notice and stop cleanly
        assert any(PREEMPT_KEY in p.data for p in of(d, PatchData))


def test_a_rollout_replica_failing_with_its_drained_sender_uses_up_no_replacement() -> None:
    d = JOB.run(_running(), _pods(DRAINED["exit 83"], BROKEN))
    s = d.status
    assert s.phase is Phase.RESTARTING
    assert (s.rollout_failures, s.rollout.replacements, s.restarts) == (0, 1, 0)


def test_a_failure_with_no_disruption_beside_it_still_counts() -> None:
    pods = JOB.pods(0, **{P0: RUNNING, P1: BROKEN, ROLLOUT: RUNNING})
    d = JOB.run(_running(), pods)
    assert d.status.phase is Phase.FAILED
    assert condition(d.status, "Failed").reason == "RestartsExhausted"
    assert P1 in d.status.message and "maxRestarts (0) used up" in d.status.message


@pytest.mark.parametrize("drained", [DRAINED["exit 83"], DRAINED["exit 143"]])
def test_a_deleted_pod_that_exited_is_a_disruption_whatever_its_code(drained: Any) -> None:
    pod = {"metadata": {"name": P0, **DELETING}, "status": drained}
    seen = observe_pod(pod)
    assert seen.disruption is not None and seen.failure is None
