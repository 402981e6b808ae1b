"""``RefitSession`` receive modes on CUDA tensors.  Real: two processes, the file rendezvous
store, NIXL over VRAM.  Run by ``bench/gpu_check.sh``."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.engine_procs import expected
from tests.support.session_procs import SessionJob, run_session_job


@pytest.mark.parametrize("mode", ["receive", "double_buffer", "in_place"])
def test_session_modes_land_bit_exact_on_cuda(tmp_path: Path, mode: str) -> None:
    reports = run_session_job(SessionJob(mode=mode, refits=3, device="cuda"), tmp_path)
    rollout = reports["rollout"]
    assert "error" not in rollout and "error" not in reports["policy"], reports
    assert rollout["refits"] == [expected(k) for k in range(3)]
