"""Drain at every stage of a refit, for topologies (1,1), (2,2) and (1,3).

Real: ``run_job`` (the operator's reconcile), ``refit-worker`` processes, NIXL, gloo, the
file rendezvous, the kubelet's drain path (DisruptionTarget + deletion -> preStop ->
SIGTERM).  Nothing is emulated.  One job per topology meets the five stages in turn, one
drain per epoch (each new gang resumes where the last one stopped), which costs six gang
starts instead of ten.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.fault_runs import (
    STAGES,
    TOPOLOGIES,
    Stage,
    Topology,
    committed_refits,
    manifest,
    rollout_logs,
    run_with,
    stage_plan,
    stop_points,
)
from tests.support.processes import processes_under

from refit_operator.models import Phase
from refit_worker.contract.exits import EXIT_PREEMPTED

#: Enough that each stage's epoch still has refits ahead when its drain goes in, though a
#: refit of this model takes only tens of milliseconds.
REFITS = 8


@pytest.mark.timeout(400)
@pytest.mark.parametrize("topo", TOPOLOGIES, ids=str)
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
    # No hang: the run ended on its own, well inside its timeout.
    assert not result.timed_out, result.status
    assert result.status.phase == Phase.SUCCEEDED, result.status
    assert [f.stage for f in observer.faults] == [s.value for s in STAGES]
    # A drain that met the last rank already done (its final refit committed first) takes
    # nothing away: no new gang.  Every other drain is a preemption.
    # The observer sees the reports a tick late: a drain it aimed before the final commit
    # may still meet the rank already done when the reconcile takes it in.
    after_done = observer.faults[-1].committed == REFITS
    expected = {len(STAGES) - 1} if after_done else {len(STAGES) - 1, len(STAGES)}
    assert result.status.preemptions in expected, result.status
    assert result.status.epoch == result.status.preemptions  # each one, a new gang
    # A drain is never a failure: no rank exited 1 (a failed bit-exact check) or was
    # SIGKILLed after its grace period.
    assert result.status.restarts == 0, result.status.message
    # A rank still starting up (before it installed its signal handler) dies of the stop
    # signal itself (143), as any container would; only the first two stages meet one.
    early = {pod for f in observer.faults[:2] for pod in f.old_pods}
    for key, code in observer.exit_codes.items():
        assert code in ({0, EXIT_PREEMPTED, 143} if key in early else {0, EXIT_PREEMPTED}), (
            key,
            code,
        )
    assert EXIT_PREEMPTED in observer.exit_codes.values()
    # Each stage was met as planned when the drain went in.
    by_stage = {Stage(f.stage): f for f in observer.faults}
    assert by_stage[Stage.BEFORE_BARRIER].published == 0
    assert not by_stage[Stage.BEFORE_BARRIER].barrier_open
    meta = by_stage[Stage.METADATA]
    assert meta.published == topo.rollout and not meta.barrier_open  # policy 0 was held
    for stage in (Stage.MID_BUCKET, Stage.BETWEEN_REFITS, Stage.FINAL_COMMIT):
        assert by_stage[stage].barrier_open
    # Timed from outside (statistical): the drain goes in once the next-to-last refit is
    # committed; on a slow tick the final refit may land first. Either way it is the last
    # refit's window, and the job must still end with every refit committed.
    assert by_stage[Stage.FINAL_COMMIT].committed in (REFITS - 1, REFITS)
    # Every gang of every epoch stopped: the kubelet saw each process exit (the last gang's
    # maybe only as the run closed, when its drain met it already done).
    assert all(key in observer.exit_codes for f in observer.faults for key in f.old_pods)
    # No rollout rank exposed a partial refit: each commit follows the bit-exact check,
    # a rank commits a contiguous run of refits from where its gang resumed, and every
    # refit of the job was committed by some rank.
    seen: set[int] = set()
    for name, text in logs.items():
        ids = committed_refits(text)
        assert "VerificationError" not in text, name
        if ids:
            assert ids == list(range(ids[0], ids[-1] + 1)), (name, ids)
        seen.update(ids)
    assert seen == set(range(REFITS))
    # Ranks stopped inside a refit at least once (mid-bucket or final commit).
    assert any("bucket boundary" in why for why in stop_points(workdir).values())
    assert not processes_under(workdir)
