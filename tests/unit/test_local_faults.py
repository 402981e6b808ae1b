"""``refit run``'s failure-domain flags: what is due when, and what the summary says.

Pure: the decision and the wording, from hand-made faults and progress entries.  The
flags' refusals are in ``test_run_command.py``; a real run is in
``tests/e2e/test_refit_run.py``.
"""

from __future__ import annotations

import json

from refit_operator.api.models import RefitJobStatus, parse_spec
from refit_operator.local import faults, view
from refit_operator.local.faults import Fault, Fired
from refit_worker.contract.rendezvous import ProgressEntry, RefitReport, progress_key

UID_A = "00000000-0000-0000-0000-00000000000a"
UID_B = "00000000-0000-0000-0000-00000000000b"


def _progress(uid: str, rank: int, refits: int, recent: int) -> tuple[str, str]:
    entry = ProgressEntry(
        epoch=0,
        uid=uid,
        role="rollout",
        rank=rank,
        refits_completed=refits,
        recent=tuple(RefitReport(refit=r, bytes=1, seconds=0.1) for r in range(recent)),
    )
    return progress_key("rollout", rank), entry.model_dump_json()


def test_a_fault_is_due_once_its_refit_is_committed_and_only_once() -> None:
    kill, scale = Fault("kill-rollout", 1), Fault("scale-rollout", 2, 3)
    plan = (kill, scale)
    assert faults.due(plan, frozenset(), 0) == []
    assert faults.due(plan, frozenset(), 1) == [kill]
    assert faults.due(plan, frozenset({kill}), 1) == []
    assert faults.due(plan, frozenset({kill}), 5) == [scale]


def test_the_replacement_counts_only_once_another_uid_committed_a_refit() -> None:
    data = dict([_progress(UID_A, 0, 2, 2)])
    latest = faults.latest_progress(data)
    # The killed pod's own last report is not its replacement's.
    assert not faults.replacement_committed(latest, "rollout", 0, UID_A)
    data = dict([_progress(UID_B, 0, 2, 0)])
    assert not faults.replacement_committed(faults.latest_progress(data), "rollout", 0, UID_A)
    data = dict([_progress(UID_B, 0, 3, 1)])
    assert faults.replacement_committed(faults.latest_progress(data), "rollout", 0, UID_A)
    assert not faults.replacement_committed(faults.latest_progress(data), "rollout", 1, UID_A)


def test_latest_progress_skips_what_it_cannot_read() -> None:
    key, value = _progress(UID_A, 0, 1, 1)
    broken = {key: value, progress_key("rollout", 1): json.dumps({"v": 3})}
    assert set(faults.latest_progress(broken)) == {("rollout", 0)}


def test_the_summary_says_whether_the_other_role_ran_on() -> None:
    fired = Fired(Fault("kill-rollout", 1), "job-rollout-0-g0", UID_A, 3.0, frozenset({UID_B}))
    fired.recovered_s = 4.25
    kept = faults.outcome(fired, frozenset())
    assert "replacement committed its first refit 4.2 s after the kill" in kept
    assert "the policy pods ran on untouched (same 1 uid(s))" in kept
    replaced = faults.outcome(fired, frozenset({UID_A}))
    assert "the policy pods did not run on untouched: 1 new policy pod(s)" in replaced
    policy = Fired(Fault("kill-policy", 2), "job-policy-0-e0", UID_A, 1.0, frozenset({UID_B}))
    assert "no refit was committed after the kill" in faults.outcome(policy, frozenset())
    assert "the rollout pods ran on untouched" in faults.outcome(policy, frozenset())


def test_without_per_replica_status_the_view_adds_no_replica_lines() -> None:
    status = RefitJobStatus()
    assert view.replica_lines(status) == []
    assert view.replacements(status) == 0


def test_the_view_shows_each_replica_and_the_replacements_from_the_status() -> None:
    raw = {
        "rollout": {"ready": 1, "total": 2, "desired": 3, "replacements": 1},
        "rolloutReplicas": [
            {
                "rank": 1,
                "generation": 0,
                "pod": "j-rollout-1-g0",
                "ready": True,
                "lastCommittedRefit": 4,
            },
            {"rank": 0, "generation": 1, "pod": "", "ready": False},
        ],
    }
    status = RefitJobStatus.model_validate(raw)
    lines = view.replica_lines(status)
    assert lines[0].split()[:3] == ["rollout-0", "generation", "1"], lines
    assert "not ready" in lines[0] and lines[0].endswith("pod -")
    assert "committed 4" in lines[1] and "j-rollout-1-g0" in lines[1]
    assert view.replacements(status) == 1
    spec = parse_spec({"image": "x", "rollout": {"replicas": 2}})
    block = view.live_lines("j", spec, status, 1.0)
    assert "rollout  ready 1/3" in block[2] and "replacements 1" in block[3]
    assert view.status_key(status) != view.status_key(RefitJobStatus())
    assert "gen0=1 gen1=0" in view.status_line("j", spec, status, 1.0)


def test_a_scale_up_counts_new_policy_pods_only_not_its_new_rollout_pods() -> None:
    from refit_operator.local.runner import RunResult

    scale = Fault("scale-rollout", 1, 3)
    result = RunResult(RefitJobStatus())
    result.fired.append(Fired(scale, "job", "", 2.0, frozenset({UID_A})))
    # The rollout pod the scale asked for appeared after it; no new policy pod did.
    result.first_seen = {"policy": {UID_A: 0.5}, "rollout": {UID_B: 3.0}}
    (line,) = view.fault_lines((scale,), result)
    assert "the policy pods ran on untouched (same 1 uid(s))" in line
    # A policy pod first seen after the scale is reported as one.
    result.first_seen["policy"][UID_B] = 4.0
    (line,) = view.fault_lines((scale,), result)
    assert "1 new policy pod(s) appeared after it" in line
