"""Failure handling of ``NIXLCheckpointEngine`` with real processes and real NIXL (UCX).

Real: separate processes, real NIXL agents, a real SIGKILL delivered with ``os.kill`` in
the middle of a refit.  Nothing is emulated.  The survivor must raise a clear error naming
the peer and what it waited for, within the configured (short) timeout; nothing hangs.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from tests.support.engine_procs import Job, run_job

TIMEOUT_S = 3.0
SLACK_S = 4.0  # process scheduling on a loaded 2-core machine, not engine behaviour


def _kill_mid_stream(victim: str) -> tuple[Any, float, Job]:
    killed_at: dict[str, float] = {}

    def kill(event: dict[str, Any], procs: dict[tuple[str, int], Any]) -> None:
        proc = procs[(victim, 0)]
        os.kill(proc.pid, signal.SIGKILL)
        killed_at["t"] = time.monotonic()

    job = Job(train=1, rollout=1, refits=1, timeout_s=TIMEOUT_S, hold_s=0.5)
    run = run_job(job, on_event=kill)
    assert "t" in killed_at, "the rollout never got a first batch"
    assert (victim, 0) not in run.reports
    return run, killed_at["t"], job


def test_killing_the_policy_mid_stream_makes_the_rollout_raise() -> None:
    run, killed_at, job = _kill_mid_stream("policy")
    report = run.reports[("rollout", 0)]
    assert report["error_type"] in {"RefitTimeoutError", "PeerError"}, report
    assert "policy rank 0" in report["error"], report["error"]
    waited = run.arrived[("rollout", 0)] - killed_at
    assert waited < TIMEOUT_S + SLACK_S + job.hold_s, f"survivor took {waited:.1f}s to notice"


def test_killing_the_rollout_mid_stream_drops_it_from_the_policys_refit() -> None:
    # A target's loss is not the sender's failure: the send returns, naming what happened.
    run, killed_at, job = _kill_mid_stream("rollout")
    report = run.reports[("policy", 0)]
    assert "error" not in report, report["error"]
    (refit,) = report["refits"]
    assert refit["delivered"] == [], refit
    reason = refit["dropped"]["0"]
    assert "rollout rank 0" in reason and ("Timeout" in reason or "PeerError" in reason), reason
    waited = run.arrived[("policy", 0)] - killed_at
    assert waited < TIMEOUT_S + SLACK_S + job.hold_s, f"survivor took {waited:.1f}s to notice"
