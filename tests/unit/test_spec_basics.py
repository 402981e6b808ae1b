"""What is read of every spec, a partly invalid one too (pure): ``managedBy``,
``ttlSecondsAfterFinished`` and ``failurePolicy.nodeLostSeconds``, each on its own, a
malformed one as its default, the rest of the spec ignored; and for a valid spec the same
values as the strict model.

Real: the models.  Nothing is emulated.
"""

from __future__ import annotations

from typing import Any

import pytest

from refit_operator.api.models import MANAGER_NAME, SpecBasics, managed_elsewhere, parse_spec


@pytest.mark.parametrize(
    ("raw", "elsewhere", "ttl", "bound"),
    [
        (None, False, None, 30.0),
        ([], False, None, 30.0),
        ({}, False, None, 30.0),
        ({"managedBy": MANAGER_NAME}, False, None, 30.0),
        ({"managedBy": None}, False, None, 30.0),
        ({"managedBy": "kueue.x-k8s.io/multikueue"}, True, None, 30.0),
        # Malformed, still another controller's word: left alone, never failed.
        ({"managedBy": "not a path"}, True, None, 30.0),
        ({"managedBy": 5}, True, None, 30.0),
        ({"ttlSecondsAfterFinished": 0}, False, 0, 30.0),
        ({"ttlSecondsAfterFinished": 60, "image": 3}, False, 60, 30.0),
        ({"ttlSecondsAfterFinished": -1}, False, None, 30.0),
        ({"ttlSecondsAfterFinished": "60"}, False, None, 30.0),
        ({"ttlSecondsAfterFinished": True}, False, None, 30.0),
        ({"ttlSecondsAfterFinished": 6.0}, False, None, 30.0),
        ({"failurePolicy": {"nodeLostSeconds": 5, "maxRestarts": "x"}}, False, None, 5.0),
        ({"failurePolicy": {"nodeLostSeconds": 2.5}}, False, None, 2.5),
        ({"failurePolicy": "none"}, False, None, 30.0),
        ({"ttl_seconds_after_finished": 5}, False, None, 30.0),  # wire names only
    ],
)
def test_each_field_on_its_own(raw: Any, elsewhere: bool, ttl: int | None, bound: float) -> None:
    basics = SpecBasics.read(raw)
    assert managed_elsewhere(basics) is managed_elsewhere(raw) is elsewhere
    assert basics.ttl_seconds_after_finished == ttl
    assert basics.node_lost_seconds == bound


@pytest.mark.parametrize(
    "raw",
    [
        {"image": "i"},
        {
            "image": "i",
            "ttlSecondsAfterFinished": 120,
            "managedBy": "example.com/other",
            "failurePolicy": {"nodeLostSeconds": 7, "maxRestarts": 1},
        },
    ],
)
def test_a_valid_spec_reads_as_the_strict_model_reads_it(raw: dict[str, Any]) -> None:
    spec, basics = parse_spec(raw), SpecBasics.read(raw)
    assert basics.managed_by == spec.managed_by
    assert basics.ttl_seconds_after_finished == spec.ttl_seconds_after_finished
    assert basics.node_lost_seconds == spec.failure_policy.node_lost_seconds
