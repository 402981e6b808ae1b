"""SIGKILL of one rank at a seeded random moment, 20 cases over four jobs.

Real: ``run_job`` (the operator's reconcile), ``refit-worker`` processes, NIXL, gloo, the
file rendezvous, ``os.kill(pid, SIGKILL)``.  Nothing is emulated.  Each job allows
``KILLS - 1`` restarts and meets ``KILLS`` kills (one per epoch, a seeded rank at a seeded
time after its gang was created or after its barrier opened): every kill but the last
restarts the gang within ``timeoutSeconds`` + backoff; the last one fails the job with a
message naming the rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.fault_runs import (
    KillPlan,
    Topology,
    manifest,
    run_with,
    seeded_kills,
)
from tests.support.processes import processes_under

from refit_operator.models import Phase

KILLS = 5
#: Kills land within this many seconds of a gang's creation (start-up, publishing, the
#: barrier wait) or of its barrier's opening (connecting, refits), half and half.
WINDOW_S = 3.0
CASES = [(Topology(1, 1), 11), (Topology(2, 2), 22), (Topology(1, 3), 13), (Topology(2, 1), 21)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("topo", "seed"), CASES, ids=[f"{t}-seed{s}" for t, s in CASES])
def test_sigkill_restarts_then_fails_naming_the_rank(
    tmp_path: Path, topo: Topology, seed: int
) -> None:
    kills = seeded_kills(seed, KILLS, topo, "kill", WINDOW_S)
    timeout, backoff = 15, 0.5
    job = manifest(
        "kill",
        topo,
        refits=1000,
        max_restarts=KILLS - 1,
        backoff=backoff,
        timeout=timeout,
        grace=10,
    )
    workdir = tmp_path / "work"
    result, observer, spec = run_with(job, KillPlan(kills), workdir, max_faults=KILLS, timeout=240)
    faults = observer.faults
    assert not result.timed_out, result.status
    assert [(f.target, f.epoch) for f in faults] == [(k.pod, e) for e, k in enumerate(kills)]
    # Each kill but the last: the gang was recreated within timeout + backoff.
    max_backoff = spec.failure_policy.max_backoff_seconds
    for fault in faults[:-1]:
        assert fault.restarted_s is not None, fault
        assert fault.restarted_s <= timeout + max_backoff, fault
    # The last kill spent maxRestarts: the job failed, naming the killed rank.
    assert result.status.phase == Phase.FAILED, result.status
    assert result.status.restarts == KILLS - 1
    last = kills[-1].pod
    # Named as a signal death, quoting no log line (its tail says nothing of the kill).
    said = f"pod {last} failed: killed by SIGKILL (exit code 137); maxRestarts (4) used up"
    assert said in result.status.message, result.status.message
    # Every killed pod died of the kill; no other rank had to be SIGKILLed after its grace
    # period: they all stopped on their own.
    killed = {(f.target, uid) for f in faults for name, uid in f.old_pods if name == f.target}
    for key, code in observer.exit_codes.items():
        assert (code == 137) == (key in killed), (key, code)
    # Every restarted gang stopped first; after the failure the run stops the last one,
    # and nothing is left in the process table.
    assert all(f.stopped_s is not None for f in faults[:-1])
    assert not processes_under(workdir)
