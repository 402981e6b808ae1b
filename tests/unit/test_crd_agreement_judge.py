"""The offline CRD judge (``tests/support/crd_judge.py``) refuses what an API server would.

Real: the generated CRD, cel-python, the models.  Nothing emulated.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.support.crd_judge import crd_verdict


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"image": "i", "colour": 1}, "spec.colour: unknown field"),
        ({}, "spec.image: required"),
        ({"image": 3}, "spec.image: must be of type string"),
        ({"image": "i", "suspend": 0}, "spec.suspend: must be of type boolean"),
        ({"image": "i", "policy": {"replicas": True}}, "must be of type integer"),
        ({"image": "i", "policy": {"replicas": 0}}, "spec.policy.replicas: below the minimum 1"),
        ({"image": "i", "transfer": {"timeoutSeconds": 0}}, "below the minimum 0"),
        ({"image": "i", "transfer": {"bucketSize": "64Mi\n"}}, "does not match"),
        ({"image": "i", "preemption": {"signal": "\u017figterm"}}, "does not match"),
        ({"image": "i", "weights": {}}, "set exactly one of weights.synthetic"),
        ({"image": "i", "policy": {"env": [{"name": "REFIT_X"}]}}, "are reserved"),
        ({"image": "i", "policy": {"replicas": 4096}}, "must be at most 4096"),
        ({"image": "i", "policy": None}, "spec.policy: must not be null"),
    ],
)
def test_the_offline_crd_judge_refuses(spec: dict[str, Any], problem: str) -> None:
    problems = crd_verdict(spec)
    assert any(problem in p for p in problems), problems


def test_defaults_come_before_the_cel_rules() -> None:
    # injection defaults to auto, signal to SIGTERM: both rules then have what they read.
    assert crd_verdict({"image": "i", "preemption": {"signal": "usr1"}}) == []
    assert crd_verdict({"image": "i", "preemption": {"injection": "stopSignal"}}) == []
    assert (
        crd_verdict({"image": "i", "preemption": {"signal": "usr1", "injection": "stopSignal"}})
        != []
    )
