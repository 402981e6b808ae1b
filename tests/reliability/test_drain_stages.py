"""Drain at every stage of a refit, for topologies (1,1), (2,2) and (1,3).

Real: ``run_job`` (the operator's reconcile), ``refit-worker`` processes, NIXL, gloo, the
file rendezvous, the kubelet's drain path (DisruptionTarget + deletion -> preStop ->
SIGTERM).  Nothing is emulated.  One job per topology meets the five stages in turn, each
a drain of the last rollout rank's pod of the time: a rollout pod is its own failure
domain, so each drain replaces that pod alone while the policy pods run on, and the next
drain meets its replacement.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.fault_runs import (
    STAGES,
    TOPOLOGIES,
    Stage,
    StopPoint,
    Topology,
    committed_refits,
    manifest,
    rollout_logs,
    run_with,
    sampled,
    sent_refits,
    stage_plan,
    stop_point,
    stop_points,
)
from tests.support.processes import processes_under

from refit_operator.api.models import Phase
from refit_worker.contract.exits import EXIT_PREEMPTED

#: Enough that the stages inside refits still have refits ahead when their drain goes in:
#: while the drained rank's replacement starts, the policy goes on refitting the others.
REFITS = 40
#: Drains that replace a pod: all but the last, which may meet the rank already done.
REPLACING = len(STAGES) - 1


#: CI's sample: two policy ranks striping to two rollout ranks meets every stage with both
#: roles plural.  (1,1) and (1,3) run in bench/reliability_report.py (REFIT_FULL_MATRIX=1
#: runs them here too); each is ~70-100 s of a loaded 2-core machine.
CI_TOPOLOGIES = (Topology(2, 2),)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("topo", sampled(TOPOLOGIES, CI_TOPOLOGIES), ids=str)
def test_drain_at_every_stage(tmp_path: Path, topo: Topology) -> None:
    # A ~27 MiB model in 16 KiB buckets: a refit outlasts the session's watch interval
    # (0.2 s), so a drain aimed inside one is seen there, at a bucket boundary; with the
    # 9 MiB model in 64 KiB buckets a refit was often over before the watcher looked.
    job = manifest("drain", topo, refits=REFITS, layers=12, bucket="16Ki")
    workdir = tmp_path / "work"
    result, observer, _ = run_with(
        job, stage_plan("drain", topo, REFITS), workdir, max_faults=len(STAGES), timeout=300
    )
    logs = rollout_logs(workdir)
    status, faults = result.status, observer.faults
    # No hang: the run ended on its own, well inside its timeout.
    assert not result.timed_out, status
    assert status.phase == Phase.SUCCEEDED, status
    assert [f.stage for f in faults] == [s.value for s in STAGES]
    # The policy pods ran on untouched: one gang, never restarted or preempted, each of
    # its pods done (exit 0) at the end.
    assert (status.epoch, status.restarts, status.preemptions) == (0, 0, 0), status.message
    policy = {key: code for key, code in observer.exit_codes.items() if "-policy-" in key[0]}
    assert len(policy) == topo.policy and set(policy.values()) == {0}, policy
    # Each drain replaced the drained pod alone, never counted as a failure; the last one
    # may meet the rank already done (its final refit committed first): nothing to replace.
    # Whether it did is the drained rank's own report, not the job's count: the other rank
    # may have committed the last refit while this one was a refit behind.
    after_done = faults[-1].target_refit == REFITS - 1
    expected = {REPLACING} if after_done else {REPLACING, REPLACING + 1}
    assert status.rollout.replacements in expected, status
    assert status.rollout_failures == 0, status
    for fault in faults[:REPLACING]:
        # Its replacement existed and was admitted to the membership.
        assert fault.restarted_s is not None and fault.recovered_s is not None, fault
    # Every drained pod stopped; only drained pods did anything but finish.  A pod drained
    # still starting up (before it installed its signal handler) dies of the stop signal
    # itself (143), as any container would; one drained after its last commit exits 0.
    drained = {key: f.stage for f in faults for key in f.old_pods}
    assert set(drained) <= set(observer.exit_codes)
    for key, code in observer.exit_codes.items():
        allowed = {0}
        if key in drained:
            allowed = {EXIT_PREEMPTED}
            allowed |= {143} if drained[key] == Stage.BEFORE_BARRIER else set()
            allowed |= {0} if drained[key] == Stage.FINAL_COMMIT else set()
        assert code in allowed, (key, code, drained.get(key))
    assert EXIT_PREEMPTED in observer.exit_codes.values()
    # Each stage was met as planned when the drain went in.
    by_stage = {Stage(f.stage): f for f in faults}
    meta = by_stage[Stage.METADATA]
    assert meta.published == topo.rollout and not meta.barrier_open  # policy 0 was held
    assert not by_stage[Stage.BEFORE_BARRIER].member
    for stage in (Stage.MID_BUCKET, Stage.BETWEEN_REFITS, Stage.FINAL_COMMIT):
        assert by_stage[stage].barrier_open and by_stage[stage].member, by_stage[stage]
    # The drain goes in once the rank committed the next-to-last refit, with the policy
    # gang held; on a slow tick the final refit may land first. Either way it is the last
    # refit's window, and the job must still end with every refit committed.
    assert by_stage[Stage.FINAL_COMMIT].committed in (REFITS - 1, REFITS)
    # No rollout rank exposed a partial refit: each commit follows the bit-exact check,
    # a pod commits a contiguous run of refits from where it joined, and every refit of
    # the job was committed by some pod.
    seen: set[int] = set()
    for name, text in logs.items():
        ids = sent_refits(text)  # a seeded first commit (issue #31) may precede a gap
        assert "VerificationError" not in text, name
        if ids:
            assert ids == list(range(ids[0], ids[-1] + 1)), (name, ids)
        seen.update(committed_refits(text))
    assert seen == set(range(REFITS))
    # Ranks stopped inside a refit at least once (mid-bucket or final commit): at a bucket
    # boundary, or by abandoning the refit when the drain took the pod out of the
    # membership before its signal arrived (which comes first is the scheduler's choice).
    inside = {StopPoint.BUCKET, StopPoint.ABANDONED}
    points = stop_points(workdir)
    assert any(stop_point(why, "preempted") in inside for why in points.values()), points
    assert not processes_under(workdir)
