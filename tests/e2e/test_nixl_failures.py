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

import pytest
from tests.support.engine_procs import Job, run_job

TIMEOUT_S = 3.0
SLACK_S = 4.0  # process scheduling on a loaded 2-core machine, not engine behaviour


@pytest.mark.parametrize(("victim", "survivor"), [("policy", "rollout"), ("rollout", "policy")])
def test_killing_a_peer_mid_stream_makes_the_survivor_raise(victim: str, survivor: str) -> None:
    killed_at: dict[str, float] = {}

    def kill(event: dict[str, Any], procs: dict[tuple[str, int], Any]) -> None:
        proc = procs[(victim, 0)]
        os.kill(proc.pid, signal.SIGKILL)
        killed_at["t"] = time.monotonic()

    job = Job(train=1, rollout=1, refits=1, timeout_s=TIMEOUT_S, hold_s=0.5)
    run = run_job(job, on_event=kill)
    assert "t" in killed_at, "the rollout never got a first batch"
    assert (victim, 0) not in run.reports
    report = run.reports[(survivor, 0)]
    assert report["error_type"] in {"RefitTimeoutError", "PeerError"}, report
    other = "policy rank 0" if survivor == "rollout" else "rollout rank 0"
    assert other in report["error"], report["error"]
    waited = run.arrived[(survivor, 0)] - killed_at["t"]
    assert waited < TIMEOUT_S + SLACK_S + job.hold_s, f"survivor took {waited:.1f}s to notice"
