"""Per-role failure domains in the pure reconcile (docs/failure-domains.md): a rollout
replica is replaced alone under its next generation, a policy failure restarts only the
policy gang, and ``rollout.replicas`` scales without a spec change."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

from tests.support.reconcile_harness import (
    NOW,
    REF,
    RUNNING,
    SUCCEEDED,
    Harness,
    condition,
    creates,
    deletes,
    of,
)

from refit_operator.api.models import Phase, PodBytes, RefitJobStatus, RolloutReplica, parse_spec
from refit_operator.core.coordinate import PatchData
from refit_operator.core.decision import Create, Emit, JobView
from refit_operator.core.observe import observe
from refit_operator.core.reconcile import reconcile
from refit_operator.render.children import render_static
from refit_operator.render.pods import RenderOptions
from refit_worker.contract.rendezvous import (
    BARRIER_KEY,
    PREEMPT_KEY,
    MetadataEntry,
    PreemptNotice,
    ProgressEntry,
    decode_entry,
    encode_entry,
    meta_key,
    progress_key,
)

SPEC: dict[str, Any] = {
    "image": "img",
    "policy": {"replicas": 1},
    "rollout": {"replicas": 2, "failurePolicy": {"maxReplacements": 2, "backoffSeconds": 1}},
    "failurePolicy": {"maxRestarts": 1, "backoffSeconds": 10},
}
JOB = Harness(SPEC)
POLICY, R0, R1 = "job-policy-0-e0", "job-rollout-0-g0", "job-rollout-1-g0"
ALL_UP = {POLICY: RUNNING, R0: RUNNING, R1: RUNNING}
FAILED: dict[str, Any] = {
    "phase": "Failed",
    "containerStatuses": [{"state": {"terminated": {"exitCode": 1}}}],
}
EVICTED: dict[str, Any] = {"phase": "Failed", "reason": "Evicted"}


def _running(**kw: Any) -> RefitJobStatus:
    """A job whose gang of epoch 0 was created and ran, its two rollout slots recorded."""
    slots = [RolloutReplica(rank=r, pod=f"job-rollout-{r}-g0") for r in (0, 1)]
    base: dict[str, Any] = {
        "phase": Phase.RUNNING,
        "created_epoch": 0,
        "ready_epoch": 0,
        "rollout_replicas": slots,
    }
    return RefitJobStatus(**{**base, **kw})


def _replica(status: RefitJobStatus, rank: int) -> RolloutReplica:
    return next(r for r in status.rollout_replicas if r.rank == rank)


def _env(obj: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in obj["spec"]["containers"][0]["env"]}


def test_a_failed_rollout_pod_is_replaced_alone_and_the_policy_pod_keeps_running() -> None:
    d = JOB.run(_running(), JOB.pods(0, **{**ALL_UP, R1: FAILED}))
    s = d.status
    assert deletes(d) == [R1]  # the policy pod and the other replica keep running
    assert (s.phase, s.epoch, s.restarts, s.preemptions) == (Phase.RUNNING, 0, 0, 0)
    assert (s.rollout.replacements, s.rollout_failures) == (1, 1)
    replica = _replica(s, 1)
    assert (replica.generation, replica.pod, replica.failures) == (1, "", 1)
    assert replica.replace_at == NOW + timedelta(seconds=1)  # the replica backoff
    assert creates(d) == []  # not before its backoff
    (event,) = [a for a in of(d, Emit) if a.reason == "RolloutReplaced"]
    assert event.type == "Warning" and "job-rollout-1-g1" in event.message
    assert "pod job-rollout-1-g0 failed: exit code 1" in event.message
    # Once the backoff is over, the next generation is created under a new name, while
    # the failed pod may still be going away.
    pods = JOB.pods(0, **{**ALL_UP, R1: FAILED})
    later = JOB.run(s, pods, now=NOW + timedelta(seconds=1))
    (pod,) = [a.obj for a in of(later, Create)]
    assert pod["metadata"]["name"] == "job-rollout-1-g1"
    assert pod["metadata"]["labels"]["refit.dev/generation"] == "1"
    assert (_env(pod)["REFIT_GENERATION"], _env(pod)["REFIT_RANK"]) == ("1", "1")
    assert _replica(later.status, 1).pod == "job-rollout-1-g1"
    assert deletes(later) == [R1] and later.status.rollout.replacements == 1  # counted once


def test_a_rollout_preemption_is_replaced_at_once_and_uses_up_no_replacement() -> None:
    spec = {**SPEC, "rollout": {"replicas": 2, "failurePolicy": {"maxReplacements": 0}}}
    d = JOB.run(_running(), JOB.pods(0, **{**ALL_UP, R0: EVICTED}), spec=spec)
    s = d.status
    assert (s.phase, s.rollout.replacements, s.rollout_failures, s.epoch) == (
        Phase.RUNNING,
        1,
        0,
        0,
    )
    assert creates(d) == ["job-rollout-0-g1"] and deletes(d) == [R0]
    (event,) = [a for a in of(d, Emit) if a.reason == "RolloutReplaced"]
    assert event.type == "Normal" and "Evicted" in event.message


def test_rollout_failures_past_max_replacements_fail_the_job() -> None:
    spent = _running(rollout_failures=2)
    d = JOB.run(spent, JOB.pods(0, **{**ALL_UP, R0: FAILED}))
    s = d.status
    assert s.phase is Phase.FAILED and s.completion_time == NOW
    assert "rollout.failurePolicy.maxReplacements (2) used up" in s.message
    assert condition(s, "Failed").reason == "ReplacementsExhausted"
    assert deletes(d) == [POLICY, R0, R1]  # the job fails: nothing of it keeps running
    assert creates(d) == []


def test_a_rank_failing_again_backs_off_twice_as_long() -> None:
    once = _running()
    once = once.model_copy(
        update={
            "rollout_replicas": [
                _replica(once, 0),
                RolloutReplica(rank=1, generation=1, pod="job-rollout-1-g1", failures=1),
            ],
            "rollout_failures": 1,
        }
    )
    pods = JOB.pods(0, rollout={0: 0, 1: 1}, **{POLICY: RUNNING, R0: RUNNING})
    pods = [p for p in pods if p["metadata"]["name"] != "job-rollout-1-g1"]
    pods += JOB.pods(0, policy=False, rollout={1: 1}, **{"job-rollout-1-g1": FAILED})
    d = JOB.run(once, pods)
    replica = _replica(d.status, 1)
    assert (replica.generation, replica.failures) == (2, 2)
    assert replica.replace_at == NOW + timedelta(seconds=2)
    assert d.status.rollout_failures == 2 and deletes(d) == ["job-rollout-1-g1"]


def test_a_policy_failure_restarts_only_the_policy_gang() -> None:
    live = JOB.pods(0, **{**ALL_UP, POLICY: EVICTED})
    d = JOB.run(_running(), live)
    s = d.status
    assert (s.phase, s.epoch, s.preemptions, s.restarts) == (Phase.RESTARTING, 1, 1, 0)
    assert deletes(d) == [POLICY]  # no rollout pod is touched
    assert [r.generation for r in s.rollout_replicas] == [0, 0]
    (patch,) = of(d, PatchData)
    notice = decode_entry(PREEMPT_KEY, str(patch.data[PREEMPT_KEY]))
    assert isinstance(notice, PreemptNotice) and notice.role == "policy"
    assert "policy gang preempted (1)" in s.message


def _meta(role: str, rank: int, epoch: int, uid: str) -> tuple[str, str]:
    key = meta_key(role, rank)  # type: ignore[arg-type]
    entry = MetadataEntry(epoch=epoch, uid=uid, role=role, rank=rank, agent='{"a": 1}')
    return key, encode_entry(key, entry)


def test_the_new_policy_epoch_keeps_the_serving_rollout_entries() -> None:
    restarting = _running(phase=Phase.RESTARTING, epoch=1, created_epoch=None)
    rollout = JOB.pods(0, policy=False, **{R0: RUNNING, R1: RUNNING})
    data = dict(
        [
            _meta("policy", 0, 0, "uid-job-policy-0-e0-0"),
            _meta("rollout", 0, 0, "uid-job-rollout-0-g0-0"),
            _meta("rollout", 1, 0, "uid-gone-replica"),  # a replaced pod's: not serving
        ]
    )
    data[BARRIER_KEY] = "{}"
    d = JOB.run(restarting, rollout, data)
    # Each map cleared of what goes: the operator's, the policy role's, the rollout role's.
    dropped = {p.name: sorted(p.data) for p in of(d, PatchData)}
    assert dropped == {
        "job-rendezvous": [BARRIER_KEY],
        "job-rendezvous-policy": ["meta.policy.0"],
        "job-rendezvous-rollout": ["meta.rollout.1"],
    }
    assert creates(d) == []  # the policy gang comes once the map is clean
    kept = {k: v for k, v in data.items() if k == "meta.rollout.0"}
    clean = JOB.run(restarting, rollout, kept)
    assert creates(clean) == ["job-policy-0-e1"] and deletes(clean) == []
    assert clean.status.created_epoch == 1


def test_scaling_rollout_up_adds_replicas_at_once_without_a_spec_change() -> None:
    grown = {**SPEC, "rollout": {**SPEC["rollout"], "replicas": 4}}
    d = JOB.run(_running(), JOB.pods(0, **ALL_UP), spec=grown, generation=2)
    s = d.status
    assert creates(d) == ["job-rollout-2-g0", "job-rollout-3-g0"] and deletes(d) == []
    assert (s.epoch, s.restarts, s.preemptions, s.rollout.replacements) == (0, 0, 0, 0)
    assert ("Warning", "SpecChanged") not in [(e.type, e.reason) for e in of(d, Emit)]
    assert [r.rank for r in s.rollout_replicas] == [0, 1, 2, 3]
    assert (s.rollout.desired, s.rollout.total, s.rollout.ready) == (4, 2, 2)
    assert s.rollout_selector == "refit.dev/job=job,refit.dev/role=rollout"


def test_scaling_rollout_down_retires_a_rank_once_it_left_or_exited() -> None:
    four = {**SPEC, "rollout": {**SPEC["rollout"], "replicas": 4}}
    shrunk = {**SPEC, "rollout": {**SPEC["rollout"], "replicas": 1}}
    pods = JOB.pods(0, four, **{POLICY: RUNNING, R0: RUNNING, R1: RUNNING})
    pods[3]["status"] = SUCCEEDED  # job-rollout-2-g0 exited 0 at the boundary
    key = progress_key("rollout", 3)
    left = ProgressEntry(epoch=0, uid="uid-job-rollout-3-g0-0", role="rollout", rank=3)
    data = {key: encode_entry(key, left.model_copy(update={"state": "left"}))}
    d = JOB.run(_running(), pods, data, spec=shrunk, generation=2)
    # Rank 1 still serves (it leaves at the next refit boundary); 2 exited, 3 left.
    assert deletes(d) == ["job-rollout-2-g0", "job-rollout-3-g0"]
    assert creates(d) == [] and d.status.epoch == 0
    assert [r.rank for r in d.status.rollout_replicas] == [0]


def test_rollout_degraded_while_fewer_replicas_serve_than_asked() -> None:
    d = JOB.run(_running(), JOB.pods(0, **{POLICY: RUNNING, R0: RUNNING}))
    assert d.status.phase is Phase.RUNNING  # the policy gang and one replica serve
    degraded = condition(d.status, "RolloutDegraded")
    assert (degraded.status, degraded.message) == ("True", "1 of 2 rollout replicas serve")
    healthy = JOB.run(_running(), JOB.pods(0, **ALL_UP))
    assert condition(healthy.status, "RolloutDegraded").status == "False"


def test_bytes_a_replaced_replica_received_stay_counted() -> None:
    key = progress_key("rollout", 1)
    entry = ProgressEntry(
        epoch=0, uid="uid-job-rollout-1-g0-0", role="rollout", rank=1, bytes_total=700
    )
    data = {key: encode_entry(key, entry)}
    d = JOB.run(_running(), JOB.pods(0, **{**ALL_UP, R1: FAILED}), data)
    assert d.status.bytes_transferred == 700
    assert d.status.bytes_counted == [PodBytes(uid=entry.uid, bytes=700)]
    # Next round: the replaced pod's report is still there; counted once.
    later = JOB.run(d.status, JOB.pods(0, **{**ALL_UP, R1: FAILED}), data)
    assert later.status.bytes_transferred == 700
    # Its last refit's report landed after the replacement: counted once, not twice.
    more = {key: encode_entry(key, entry.model_copy(update={"bytes_total": 900}))}
    late = JOB.run(later.status, JOB.pods(0, **{**ALL_UP, R1: FAILED}), more)
    assert late.status.bytes_transferred == 900
    again = JOB.run(late.status, JOB.pods(0, **{**ALL_UP, R1: FAILED}), more)
    assert again.status.bytes_transferred == 900
    # Its replacement's report takes the key: the old pod's bytes stay, the new one's add.
    new = entry.model_copy(update={"uid": "uid-job-rollout-1-g1-0", "bytes_total": 50})
    taken = {key: encode_entry(key, new)}
    after = JOB.run(again.status, JOB.pods(0, **ALL_UP), taken)
    assert after.status.bytes_transferred == 950


def test_each_replica_reports_its_generation_pod_and_last_committed_refit() -> None:
    key = progress_key("rollout", 1)
    entry = ProgressEntry(
        epoch=0, uid="uid-job-rollout-1-g0-0", role="rollout", rank=1, refits_completed=4
    )
    d = JOB.run(_running(), JOB.pods(0, **ALL_UP), {key: encode_entry(key, entry)})
    replica = _replica(d.status, 1)
    assert (replica.generation, replica.pod, replica.ready) == (0, R1, True)
    assert replica.last_committed_refit == 4


def test_a_pod_on_a_lost_node_is_replaced_without_waiting_for_it() -> None:
    static = render_static(REF, parse_spec(SPEC))
    observed = observe(JOB.pods(0, **ALL_UP), static, {"job-rendezvous": {}})
    lost = tuple(
        replace(p, node_lost="node node-a NotReady for 45 s") if p.name == R0 else p
        for p in observed.pods
    )
    job = JobView(ref=REF, generation=1, raw_spec=SPEC, status=_running())
    d = reconcile(job, replace(observed, pods=lost), NOW, RenderOptions())
    assert creates(d) == ["job-rollout-0-g1"]  # at once: the stuck pod is never waited for
    assert d.status.rollout_failures == 0 and d.status.epoch == 0
    (event,) = [a for a in of(d, Emit) if a.reason == "RolloutReplaced"]
    assert event.type == "Normal" and "NodeLost: node node-a NotReady" in event.message
