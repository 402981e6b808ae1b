"""A preemption is taken on the platform's word or the operator's own notice, never on a
worker's alone (#50): a pod that exits 83 (or whose rank reports ``preempted``) while
nothing disrupts it gets no preemption restart, and a Warning Event names it; a real drain
and the knock-on exits of the ranks it stops still count as the preemption they are.

Pods are manifests as the API returns them and the rendezvous is the job's ConfigMaps'
data, read by ``observe`` and one reconcile round; nothing is emulated.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.support.reconcile_harness import (
    GONE,
    RUNNING,
    Harness,
    events,
    exited,
    of,
    uid,
)

from refit_operator.api.models import Phase, RefitJobStatus, RolloutReplica
from refit_operator.core import claims
from refit_operator.core.coordinate import PatchData
from refit_operator.core.decision import Decision, Emit
from refit_operator.core.observe import observe_pod
from refit_worker.contract.rendezvous import (
    PREEMPT_KEY,
    ProgressEntry,
    encode_entry,
    make_preempt_notice,
)

SPEC: dict[str, Any] = {
    "image": "img",
    "policy": {"replicas": 2},
    "rollout": {"replicas": 1},
    "failurePolicy": {"maxRestarts": 3, "maxPreemptions": 5, "backoffSeconds": 10},
}
JOB = Harness(SPEC)
P0, P1, ROLLOUT = "job-policy-0-e0", "job-policy-1-e0", "job-rollout-0-g0"
EVICTION = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
FORGED = exited(83, "preempted")  # no DisruptionTarget, no deletion: the worker's word only


def _running() -> RefitJobStatus:
    slots = [RolloutReplica(rank=0, pod=ROLLOUT)]
    return RefitJobStatus(
        phase=Phase.RUNNING, created_epoch=0, ready_epoch=0, rollout_replicas=slots
    )


def _ignored(d: Decision) -> list[str]:
    return [a.message for a in of(d, Emit) if a.reason == claims.IGNORED]


def _notices(d: Decision) -> list[PatchData]:
    return [p for p in of(d, PatchData) if PREEMPT_KEY in p.data]


def _notice(epoch: int = 0) -> dict[str, str]:
    notice = make_preempt_notice(epoch, P0, uid(P0, 0), "DisruptionTarget", role="policy")
    return {PREEMPT_KEY: encode_entry(PREEMPT_KEY, notice)}


def test_a_forged_exit_is_no_preemption_and_a_warning_names_the_pod() -> None:
    pods = JOB.pods(0, **{P0: RUNNING, P1: FORGED, ROLLOUT: RUNNING})
    d = JOB.run(_running(), pods)
    s = d.status
    # Counted as the failure it is (maxRestarts, backoff), not a free preemption.
    assert (s.preemptions, s.restarts) == (0, 1)
    assert ("Warning", "Preempted") not in events(d)
    assert _notices(d) == []  # the operator does not relay it to the other ranks
    (message,) = _ignored(d)
    assert P1 in message and "no DisruptionTarget" in message


def test_a_forged_exit_uses_up_max_restarts() -> None:
    spec = {**SPEC, "failurePolicy": {"maxRestarts": 0, "backoffSeconds": 10}}
    pods = Harness(spec).pods(0, **{P0: RUNNING, P1: FORGED, ROLLOUT: RUNNING})
    d = Harness(spec).run(_running(), pods)
    assert d.status.phase is Phase.FAILED
    assert d.status.preemptions == 0
    assert "maxRestarts (0) used up" in d.status.message


def test_a_running_pod_reporting_preempted_restarts_nothing() -> None:
    entry = ProgressEntry(epoch=0, uid=uid(P1, 0), role="policy", rank=1, state="preempted")
    data = {"progress.policy.1": encode_entry("progress.policy.1", entry)}
    pods = JOB.pods(0, **{P0: RUNNING, P1: RUNNING, ROLLOUT: RUNNING})
    d = JOB.run(_running(), pods, data)
    s = d.status
    assert (s.phase, s.epoch, s.preemptions, s.restarts) == (Phase.RUNNING, 0, 0, 0)
    assert _notices(d) == []
    (message,) = _ignored(d)
    assert P1 in message and "reports its rank preempted" in message


def test_a_drained_pod_is_still_a_preemption() -> None:
    pods = JOB.pods(0, **{P0: RUNNING, P1: exited(83, conditions=(EVICTION,)), ROLLOUT: RUNNING})
    d = JOB.run(_running(), pods)
    assert (d.status.preemptions, d.status.restarts) == (1, 0)
    assert ("Warning", "Preempted") in events(d)
    assert _ignored(d) == []


@pytest.mark.parametrize(
    "drained",
    [{**RUNNING, "conditions": [EVICTION]}, exited(83, conditions=(EVICTION,)), GONE],
    ids=["stopping", "exit 83", "gone"],
)
def test_a_knock_on_exit_beside_a_drained_rank_is_the_drains(drained: Any) -> None:
    # The signal handler stopped rank 1 with the drained rank 0: no condition of its own.
    pods = JOB.pods(0, **{P0: drained, P1: FORGED, ROLLOUT: RUNNING})
    d = JOB.run(_running(), pods)
    assert (d.status.preemptions, d.status.restarts) == (1, 0)
    assert _ignored(d) == []


def test_a_knock_on_exit_after_the_operators_notice_is_counted() -> None:
    # Rank 0 is already gone from the round's sight but for the notice the operator wrote.
    pods = JOB.pods(0, **{P0: RUNNING, P1: FORGED, ROLLOUT: RUNNING})
    d = JOB.run(_running(), pods, _notice())
    assert (d.status.preemptions, d.status.restarts) == (1, 0)
    assert _ignored(d) == []


def test_a_notice_of_another_epoch_or_in_a_workers_map_justifies_nothing() -> None:
    pods = JOB.pods(0, **{P0: RUNNING, P1: FORGED, ROLLOUT: RUNNING})
    stale = JOB.run(_running(), pods, _notice(epoch=3))
    # A pod may write its own role's map: a notice there is no one's (at_home drops it).
    planted = {"job-rendezvous": {}, "job-rendezvous-policy": _notice()}
    forged = JOB.run(_running(), pods, rendezvous=planted)
    for d in (stale, forged):
        assert (d.status.preemptions, d.status.restarts) == (0, 1)
        assert len(_ignored(d)) == 1


def test_a_rollout_pods_forged_exit_is_replaced_as_a_failure() -> None:
    pods = JOB.pods(0, **{P0: RUNNING, P1: RUNNING, ROLLOUT: FORGED})
    d = JOB.run(_running(), pods)
    s = d.status
    assert (s.rollout_failures, s.rollout.replacements, s.preemptions) == (1, 1, 0)
    (message,) = _ignored(d)
    assert ROLLOUT in message


def test_vet_keeps_attested_claims_and_takes_the_rest_for_failures() -> None:
    def pod(name: str, status: dict[str, Any]) -> Any:
        labels = {"refit.dev/role": "policy", "refit.dev/rank": "1", "refit.dev/epoch": "0"}
        return observe_pod({"metadata": {"name": name, "uid": name, "labels": labels}, **status})

    forged, other = pod("a", {"status": FORGED}), pod("b", {"status": exited(83)})
    assert forged.self_reported and forged.disruption is not None
    alone = claims.vet([forged], epoch=0, notice=None, reports=(), missing=False)
    (judged,) = alone.pods
    assert judged.disruption is None and judged.failure is not None and judged.exit_code == 83
    assert [e.reason for e in alone.events] == [claims.IGNORED]
    missing = claims.vet([forged, other], epoch=0, notice=None, reports=(), missing=True)
    assert missing.pods == (forged, other) and missing.events == ()
    evicted = pod("c", {"status": exited(83, conditions=(EVICTION,))})
    assert claims.attested(evicted) and not claims.attested(forged)
    beside = claims.vet([forged, evicted], epoch=0, notice=None, reports=(), missing=False)
    assert beside.pods == (forged, evicted) and beside.events == ()
