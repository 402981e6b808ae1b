"""``refit run``'s metrics ports: one per rank on one host (pure; the probe is passed in)."""

from __future__ import annotations

import pytest

from refit_operator.api.models import RefitJobSpec, parse_spec
from refit_operator.api.names import MASTER_PORT, pod_labels
from refit_operator.local.metrics_ports import PortsError, describe, plan, port_of


def _spec(port: int, policy: int = 2, rollout: int = 2) -> RefitJobSpec:
    return parse_spec(
        {
            "image": "i",
            "policy": {"replicas": policy},
            "rollout": {"replicas": rollout},
            "metrics": {"port": port},
        }
    )


def test_ports_count_up_skipping_busy_ones_and_the_rendezvous_port() -> None:
    busy = {9401, 9403}
    ports = plan(_spec(9400), lambda p: p not in busy)
    assert ports == {
        ("policy", 0): 9400,
        ("policy", 1): 9402,
        ("rollout", 0): 9404,
        ("rollout", 1): 9405,
    }
    around = plan(_spec(MASTER_PORT - 1, 1, 1), lambda p: True)
    assert list(around.values()) == [MASTER_PORT - 1, MASTER_PORT + 1]


def test_no_metrics_no_ports_and_too_few_free_ports_is_refused() -> None:
    assert plan(parse_spec({"image": "i"}), lambda p: True) == {}
    with pytest.raises(PortsError, match="not enough free ports above it for 4 ranks"):
        plan(_spec(65534), lambda p: True)


def test_a_rendered_pod_finds_its_port_and_the_line_names_each() -> None:
    ports = plan(_spec(9400, 1, 1), lambda p: True)
    pod = {"metadata": {"labels": pod_labels("j", "rollout", 0, 3)}}
    assert port_of(ports, pod) == 9401
    assert port_of(ports, {"metadata": {}}) is None
    assert describe("j", ports).endswith("per rank: j-policy-0 :9400, j-rollout-0 :9401")
