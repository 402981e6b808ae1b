"""The engine on CUDA: VRAM receive buffers, landing memory and final tensors.

Real: separate processes on one GPU, real NIXL (UCX, VRAM memory type), the same helpers as
``tests/e2e/test_nixl_engine.py``.  Run by ``bench/gpu_check.sh``.
"""

from __future__ import annotations

import pytest
from tests.support.engine_procs import Job, assert_all_ok, run_job


@pytest.mark.parametrize("into", [False, True], ids=["views", "into-final-tensors"])
def test_refits_arrive_bit_exact_in_vram(into: bool) -> None:
    job = Job(train=1, rollout=1, refits=3, device="cuda", into=into, engine={"checksum": True})
    assert_all_ok(run_job(job), job)


def test_tensor_parallel_slices_are_complete_before_the_nic_reads_them() -> None:
    # Slices along dim 1 are non-contiguous: the sender copies each on the current stream;
    # the WRITE must wait for those copies (sources_ready), or the receiver gets garbage.
    layouts = {
        "0": {"tp_rank": 0, "tp_size": 2, "tp_dims": {r"q_proj": 1}},
        "1": {"tp_rank": 1, "tp_size": 2, "tp_dims": {r"q_proj": 1}},
    }
    job = Job(
        train=1,
        rollout=2,
        refits=2,
        layouts=layouts,
        experts=2,
        device="cuda",
        engine={"checksum": True},
    )
    assert_all_ok(run_job(job), job)
