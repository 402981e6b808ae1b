"""``refit run``'s sizing: pure estimates judged against a machine passed in."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import yaml

from refit_operator.api.models import parse_spec
from refit_operator.local.sizing import BUFFERS_PER_RANK, WORKER_FLOOR_BYTES, estimate, judge
from refit_worker.contract.synthetic import synthetic_nbytes
from refit_worker.engine import NIXL_TRANSFER_BUFFER_COUNT, NIXLCheckpointEngine

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]


def test_estimate_counts_the_floor_weights_and_buffers() -> None:
    spec = parse_spec({"image": "i", "policy": {"replicas": 2}, "transfer": {"bucketSize": "1Mi"}})
    est = estimate(spec, model_bytes=100 << 20)
    policy = 2 * (WORKER_FLOOR_BYTES + (100 << 20) + (2 << 20))
    rollout = WORKER_FLOOR_BYTES + 3 * (100 << 20) + (2 << 20)
    assert est.processes == 3
    assert est.total_bytes == policy + rollout


def test_custom_commands_count_processes_but_not_memory() -> None:
    spec = parse_spec(
        {
            "image": "i",
            "policy": {"command": ["/bin/true"]},
            "rollout": {"command": ["/bin/true"]},
        }
    )
    est = estimate(spec, model_bytes=50 * GIB)
    assert (est.processes, est.total_bytes) == (2, 0)


@pytest.mark.parametrize(
    ("available", "cores", "verdict"),
    [(24 * GIB, 2, "ok"), (3 * GIB, 2, "warn"), (GIB, 2, "refuse")],
)
def test_judge_by_available_memory(available: int, cores: int, verdict: str) -> None:
    spec = parse_spec({"image": "i", "policy": {"replicas": 1}})
    got, sentence = judge(estimate(spec, model_bytes=100 << 20), available, cores)
    assert got == verdict
    assert "worker processes" in sentence


def test_judge_refuses_more_processes_than_the_cores_can_start() -> None:
    spec = parse_spec({"image": "i", "policy": {"command": ["x"]}, "rollout": {"replicas": 40}})
    got, sentence = judge(estimate(spec, None), 1000 * GIB, 2)
    assert got == "refuse"
    assert "41 worker processes on 2 cores" in sentence


def test_a_bucket_larger_than_the_model_counts_in_full() -> None:
    """Every rank allocates its buffers, a whole bucket each, before it knows the model
    (``RolloutKept.offer``): the estimate counts what is allocated (issue #50)."""
    demo = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())["spec"]
    demo["transfer"]["bucketSize"] = "10Gi"
    spec = parse_spec(demo)
    assert spec.weights.synthetic is not None
    model = synthetic_nbytes(spec.weights.synthetic)
    est = estimate(spec, model_bytes=model)
    per_process = WORKER_FLOOR_BYTES + BUFFERS_PER_RANK * 10 * GIB
    assert est.total_bytes == 2 * (per_process + model) + 2 * (per_process + 3 * model)
    verdict, sentence = judge(est, 64 * GIB, 2)
    assert verdict == "refuse"
    assert "spec.transfer.bucketSize: each rank allocates 2 buckets of 10.0 GiB" in sentence
    # The model's size changes nothing of the buffers.
    assert estimate(spec, None).total_bytes == est.total_bytes - 8 * model


def test_the_buffers_counted_are_the_ones_the_engine_allocates() -> None:
    assert BUFFERS_PER_RANK == NIXL_TRANSFER_BUFFER_COUNT
    default = inspect.signature(NIXLCheckpointEngine).parameters["buffer_count"].default
    assert default == BUFFERS_PER_RANK


def test_a_refusal_names_the_bucket_only_when_it_outgrows_the_model() -> None:
    spec = parse_spec({"image": "i", "rollout": {"replicas": 3}, "transfer": {"bucketSize": "1Mi"}})
    verdict, sentence = judge(estimate(spec, 100 * GIB), 8 * GIB, 2)
    assert verdict == "refuse" and "bucketSize" not in sentence


def test_a_bucket_smaller_than_the_model_counts_in_full() -> None:
    spec = parse_spec({"image": "i", "transfer": {"bucketSize": "1Mi"}})
    small, large = estimate(spec, 100 << 20), estimate(spec, 200 << 20)
    # One policy and one rollout rank: 1 + 3 copies of the model more, buffers the same.
    assert large.total_bytes - small.total_bytes == 4 * (100 << 20)
