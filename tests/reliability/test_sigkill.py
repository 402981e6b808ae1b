"""SIGKILL of one rank at a seeded random moment, 20 cases over four jobs.

Real: ``run_job`` (the operator's reconcile), ``refit-worker`` processes, NIXL, gloo, the
file rendezvous, ``os.kill(pid, SIGKILL)``.  Nothing is emulated.  Each job meets ``KILLS``
kills (a seeded rank at a seeded time after the last kill's replacement was created or
took part), one after another.  Each role is its own failure domain: a killed rollout pod
is replaced alone (``rollout.failurePolicy.maxReplacements``), a killed policy pod
restarts the policy gang (``maxRestarts``) while the rollout pods run on.  Each job's
budgets let every kill but the last through; the last one spends its role's budget and
fails the job with a message naming the rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.fault_runs import (
    KillPlan,
    Topology,
    manifest,
    rank_of,
    run_with,
    sampled,
    seeded_kills,
)
from tests.support.processes import processes_under

from refit_operator.api.models import Phase

KILLS = 5
#: Kills land within this many seconds of a round's start (the last kill's replacement
#: created: start-up, publishing, joining) or of its settling (that replacement taking
#: part: connecting, refits), half and half.
WINDOW_S = 3.0
ALL_CASES = [(Topology(1, 1), 11), (Topology(2, 2), 22), (Topology(1, 3), 13), (Topology(2, 1), 21)]
#: CI's sample: plural policy ranks (a policy kill restarts a gang of two) and a fan-out
#: to three rollout ranks; the other cases run in bench/reliability_report.py's 20 kills
#: (and here with REFIT_FULL_MATRIX=1).
CASES = sampled(ALL_CASES, [(Topology(2, 2), 22), (Topology(1, 3), 13)])


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("topo", "seed"), CASES, ids=[f"{t}-seed{s}" for t, s in CASES])
def test_sigkill_replaces_or_restarts_then_fails_naming_the_rank(
    tmp_path: Path, topo: Topology, seed: int
) -> None:
    kills = seeded_kills(seed, KILLS, topo, "kill", WINDOW_S)
    roles = ["policy" if "-policy-" in k.pod else "rollout" for k in kills]
    before_last = roles[:-1]
    restarts, replacements = before_last.count("policy"), before_last.count("rollout")
    # A replacement joins within timeoutSeconds, or the one rollout rank's policy gives
    # up waiting for a member: roomy enough for a worker's start-up on a loaded machine.
    timeout, backoff = 30, 0.5
    job = manifest(
        "kill",
        topo,
        refits=1000,
        max_restarts=restarts,
        max_replacements=replacements,
        backoff=backoff,
        timeout=timeout,
        grace=10,
    )
    workdir = tmp_path / "work"
    result, observer, spec = run_with(job, KillPlan(kills), workdir, max_faults=KILLS, timeout=240)
    faults, status = observer.faults, result.status
    assert not result.timed_out, status
    assert [f.target.rsplit("-", 1)[0] for f in faults] == [k.pod for k in kills]
    # Each kill but the last: its replacement (the rank's next generation, or the next
    # epoch's policy gang) existed within timeoutSeconds + the role's longest back-off.
    for fault in faults[:-1]:
        slot = rank_of(fault.target)
        assert slot is not None, fault
        if slot[0] == "policy":
            bound = timeout + spec.failure_policy.max_backoff_seconds
        else:
            bound = timeout + spec.rollout_failure_policy.max_backoff_seconds
        assert fault.restarted_s is not None and fault.restarted_s <= bound, fault
    # Per role: only policy kills moved the epoch and used up restarts; rollout kills used
    # up replacements.
    assert (status.epoch, status.restarts) == (restarts, restarts), status
    assert status.rollout_failures == replacements, status
    # The last kill spent its role's budget: the job failed, naming the killed pod as a
    # signal death, quoting no log line (its tail says nothing of the kill).
    assert status.phase == Phase.FAILED, status
    last = faults[-1].target
    limit = (
        f"maxRestarts ({restarts})"
        if roles[-1] == "policy"
        else f"rollout.failurePolicy.maxReplacements ({replacements})"
    )
    said = f"pod {last} failed: killed by SIGKILL (exit code 137); {limit} used up"
    assert said in status.message, status.message
    # Every killed pod died of the kill; no other pod had to be SIGKILLed after its grace
    # period: they all stopped on their own.
    killed = {(f.target, uid) for f in faults for name, uid in f.old_pods if name == f.target}
    for key, code in observer.exit_codes.items():
        assert (code == 137) == (key in killed), (key, code)
    # Every fault's pods stopped; after the failure the run stops the rest, and nothing
    # is left in the process table.
    assert all(f.stopped_s is not None for f in faults[:-1])
    assert not processes_under(workdir)
