"""End-to-end refits through ``NIXLCheckpointEngine``.

Real: separate processes per rank (multiprocessing spawn), real NIXL agents with the UCX
backend moving CPU memory, metadata exchanged as JSON text.  Nothing is emulated.  Each rank
reports a sha256 per received tensor; the test compares it with the sender's tensors
(bit-exact, including bf16, fp16, fp32, int8, bool, float8_e4m3fn, a zero-size tensor and a
tensor larger than a bucket).  One test makes an engine in the test's own process, to read
what ``prepare()`` allocates.
"""

from __future__ import annotations

import pytest
from tests.support.engine_procs import Job, assert_all_ok, expected, run_job, state_dict

from refit_operator.local.sizing import BUFFERS_PER_RANK
from refit_worker.engine import NIXLCheckpointEngine


def test_big_tensor_really_spans_buckets() -> None:
    job = Job(train=1, rollout=1)
    big = state_dict(0)["big.weight"]
    assert big.numel() * big.element_size() > 4 * job.bucket_size
    assert state_dict(0)["empty.bias"].numel() == 0
    assert expected(0) != expected(1)


@pytest.mark.parametrize(
    ("train", "rollout"),
    [(1, 1), (2, 2), (3, 2), (1, 3), (2, 3)],
    ids=["1x1-pair", "2x2-pair", "3x2-stripe", "1x3-fanout", "2x3-fanout"],
)
def test_refits_arrive_bit_exact(train: int, rollout: int) -> None:
    job = Job(train=train, rollout=rollout, refits=3, engine={"checksum": train == 3})
    assert_all_ok(run_job(job), job)


@pytest.mark.parametrize(
    ("train", "rollout"), [(1, 1), (3, 2), (1, 3)], ids=["1x1-pair", "3x2-stripe", "1x3-fanout"]
)
def test_refits_land_bit_exact_in_final_tensors_with_integrity(train: int, rollout: int) -> None:
    # receive_into: every byte WRITTEN straight into the rollout's own tensors, hashed on
    # both sides; striping senders and a fan-out sender (one hash per bucket) included.
    job = Job(train=train, rollout=rollout, refits=2, into=True, engine={"checksum": True})
    assert_all_ok(run_job(job), job)


def test_expert_and_tensor_parallel_layout_sends_only_wanted_parts() -> None:
    layouts = {
        "0": {"expert_ids": [0, 2], "tp_rank": 0, "tp_size": 2, "tp_dims": {r"q_proj": 0}},
        "1": {"expert_ids": [1, 3], "tp_rank": 1, "tp_size": 2, "tp_dims": {r"q_proj": 1}},
    }
    job = Job(train=2, rollout=2, refits=1, layouts=layouts, experts=4)
    run = run_job(job)
    assert_all_ok(run, job)
    got0 = run.reports[("rollout", 0)]["refits"][0]
    assert "layers.0.mlp.experts.1.up.weight" not in got0
    assert "layers.0.mlp.experts.2.up.weight" in got0
    assert "[8, 16]" in got0["layers.0.attn.q_proj.weight"]
    assert "[16, 8]" in run.reports[("rollout", 1)]["refits"][0]["layers.0.attn.q_proj.weight"]


def test_declared_uneven_slices_send_each_rank_only_its_rows() -> None:
    # Per-name parts as a vLLM worker declares them: uneven splits (257 embedding rows as
    # 129 + 128, 301 columns as 150 + 151) that no equal tp_dims split can say.
    emb, big = "embed.weight", "big.weight"
    layouts = {
        "0": {"tp_rank": 0, "tp_size": 2, "slices": {emb: [0, 0, 129], big: [1, 0, 150]}},
        "1": {"tp_rank": 1, "tp_size": 2, "slices": {emb: [0, 129, 257], big: [1, 150, 301]}},
    }
    job = Job(train=2, rollout=2, refits=1, layouts=layouts)
    run = run_job(job)
    assert_all_ok(run, job)  # every byte equal to the sender's rows, per rank
    first, second = (run.reports[("rollout", r)]["refits"][0] for r in (0, 1))
    assert "[129, 64]" in first[emb] and "[128, 64]" in second[emb]
    assert "[300, 150]" in first[big] and "[300, 151]" in second[big]


def test_release_after_refit_sets_up_again_on_prepare() -> None:
    job = Job(train=1, rollout=2, refits=2, release_cycles=True)
    assert_all_ok(run_job(job), job)


def test_prepare_allocates_what_refit_run_sizes_a_rank_by() -> None:
    """Every rank allocates its receive buffers, a whole bucket each, before it knows the
    model or its role: ``refit run``'s sizing counts them so (issue #50).  In this
    process: one real agent, CPU memory."""
    bucket = 3 << 20
    engine = NIXLCheckpointEngine(bucket, device="cpu", backend_name="UCX")
    try:
        offered = engine.prepare().buffers
    finally:
        engine.finalize()
    assert [b.length for b in offered] == [bucket] * BUFFERS_PER_RANK
