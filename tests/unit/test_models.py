"""The RefitJob models: defaults, the specific error for each bad input (pure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.support.crd_judge import crd_verdict

from refit_operator.api.models import (
    InvalidSpecError,
    Phase,
    RefitJobStatus,
    parse_spec,
    parse_status,
)

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "refitjob.yaml"


def test_sample_manifest_parses_with_defaults() -> None:
    spec = parse_spec(yaml.safe_load(SAMPLE.read_text())["spec"])
    assert spec.policy.replicas == 2 and spec.rollout.replicas == 2
    assert spec.transfer.bucket_bytes == 16 << 20
    assert spec.preemption.signal_name == "SIGUSR1"
    assert spec.failure_policy.max_restarts == 1
    assert spec.image_pull_policy == "IfNotPresent" and spec.suspend is False
    assert spec.weights.synthetic is not None and spec.weights.synthetic.hidden == 64


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"preemption": {"signal": "SIGBOGUS"}},
            "spec.preemption.signal: Value error, Unknown signal name 'SIGBOGUS'",
        ),
        ({"preemption": {"signal": "SIGKILL"}}, "cannot be caught"),
        ({"preemption": {"signal": "usr1", "injection": "stopSignal"}}, "write it as 'SIGUSR1'"),
        (
            {"transfer": {"bucketSize": "0"}},
            "spec.transfer.bucketSize: Value error, bucketSize '0' must be more than 0 bytes",
        ),
        (
            {"transfer": {"bucketSize": "64MB"}},
            "spec.transfer.bucketSize: Value error, bucketSize '64MB' is not a whole number",
        ),
        (
            {"policy": {"replicas": 0}},
            "spec.policy.replicas: Input should be greater than or equal to 1 (got 0)",
        ),
        (
            {"rollout": {"replicas": "many"}},
            "spec.rollout.replicas: Input should be a valid integer",
        ),
        ({"colour": "blue"}, "spec.colour: Extra inputs are not permitted (got 'blue')"),
        ({"policy": {"replicaz": 2}}, "spec.policy.replicaz: Extra inputs are not permitted"),
        ({"policy": {"env": [{"name": "REFIT_RANK", "value": "3"}]}}, "'REFIT_RANK' is reserved"),
        ({"weights": {}}, "set exactly one of weights.synthetic and weights.safetensors"),
        ({"image": ""}, "spec.image: String should have at least 1 character"),
        ({"transfer": {"device": "tpu"}}, "spec.transfer.device: Input should be 'cpu' or 'cuda'"),
        ({"failurePolicy": {"maxRestarts": -1}}, "spec.failurePolicy.maxRestarts"),
        (
            {"policy": {"replicas": 4000}, "rollout": {"replicas": 100}},
            "policy.replicas + rollout.replicas = 4100 is over 4096",
        ),
    ],
)
def test_bad_input_names_the_field_and_value(change: dict[str, Any], message: str) -> None:
    raw = {"image": "img", **change}
    with pytest.raises(InvalidSpecError) as info:
        parse_spec(raw)
    assert message in str(info.value)


def test_failure_policy_per_role_is_rollouts_only_and_both_judges_say_so() -> None:
    rollout = {"replicas": 2, "failurePolicy": {"maxReplacements": 5, "backoffSeconds": 2}}
    spec = parse_spec({"image": "img", "rollout": rollout})
    assert spec.rollout_failure_policy.max_replacements == 5
    assert spec.rollout_failure_policy.max_backoff_seconds == 30  # the default
    assert parse_spec({"image": "img"}).rollout_failure_policy.max_replacements == 20
    assert parse_spec({"image": "img"}).failure_policy.node_lost_seconds == 30
    assert crd_verdict({"image": "img", "rollout": rollout}) == []
    refused = {"image": "img", "policy": {"failurePolicy": {"maxReplacements": 1}}}
    with pytest.raises(InvalidSpecError) as info:
        parse_spec(refused)
    assert "policy.failurePolicy is not allowed" in str(info.value)
    assert any("policy.failurePolicy is not allowed" in p for p in crd_verdict(refused))


def test_missing_image_and_non_object_spec() -> None:
    with pytest.raises(InvalidSpecError, match=r"spec\.image: Field required"):
        parse_spec({})
    with pytest.raises(InvalidSpecError, match="spec must be an object, got list"):
        parse_spec([])


@pytest.mark.parametrize(
    ("name", "canonical"), [("SIGTERM", "SIGTERM"), ("term", "SIGTERM"), ("sigusr2", "SIGUSR2")]
)
def test_signal_names(name: str, canonical: str) -> None:
    spec = parse_spec({"image": "img", "preemption": {"signal": name}})
    assert spec.preemption.signal_name == canonical
    assert spec.preemption.parsed_signal.name == canonical


def test_status_round_trips_and_tolerates_garbage() -> None:
    status = RefitJobStatus(phase=Phase.RUNNING, epoch=2, restarts=1, preemptions=3)
    wire = status.model_dump(mode="json", by_alias=True)
    assert wire["phase"] == "Running" and wire["refitsCompleted"] == 0
    assert parse_status(wire) == status
    assert parse_status({**wire, "kopf": {"x": 1}}) == status  # unknown keys ignored
    assert parse_status(None) == RefitJobStatus()
    assert parse_status({"epoch": "not a number"}) == RefitJobStatus()


@pytest.mark.parametrize(
    ("written", "nbytes"),
    [
        (1048576, 1 << 20),
        ("1048576", 1 << 20),
        ("1Mi", 1 << 20),
        ("64M", 64 * 10**6),
        # The bounds: one element of the widest dtype, and the largest bucket (issue #50).
        (8, 8),
        ("8", 8),
        ("64Gi", 64 << 30),
        (64 << 30, 64 << 30),
        ("68719476k", 68719476000),
    ],
)
def test_bucket_size_as_the_docs_write_it(written: int | str, nbytes: int) -> None:
    """docs/cluster.md: quantities may be integers; the error text itself suggests 1048576."""
    spec = {"image": "img", "transfer": {"bucketSize": written}}
    assert parse_spec(spec).transfer.bucket_bytes == nbytes
    assert crd_verdict(spec) == [], "the API server would refuse what the operator takes"
