"""``refit operator``'s flags for operating it: endpoints and leader election are parsed
and checked before anything connects; a bad value is refused by name.  No API, no kopf.
"""

from __future__ import annotations

import pytest

from refit_operator.cli import build_parser, main
from refit_operator.shell.endpoints import Address


def test_endpoint_addresses() -> None:
    args = build_parser().parse_args(
        ["operator", "--health-probe-bind-address=:8081", "--metrics-bind-address=127.0.0.1:9"]
    )
    assert (args.health_probe_bind_address, args.metrics_bind_address) == (
        "0.0.0.0:8081",
        "127.0.0.1:9",
    )
    assert Address.parse("[::1]:80") == Address("::1", 80)


@pytest.mark.parametrize("value", ["8081", ":0", ":65536", "host:", "host:http"])
def test_bad_addresses_are_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["operator", f"--metrics-bind-address={value}"])
    assert exited.value.code == 2
    assert "not HOST:PORT" in capsys.readouterr().err


def test_leader_election_needs_a_namespace(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    assert main(["operator", "--leader-elect"]) == 2
    assert "--leader-election-namespace" in capsys.readouterr().err


def test_leader_election_timing_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "operator",
            "--leader-elect",
            "--leader-election-namespace=ops",
            "--leader-elect-lease-duration=5",
            "--leader-elect-renew-deadline=5",
        ]
    )
    assert code == 2
    assert "must be longer than the renew deadline" in capsys.readouterr().err


def test_leader_election_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from refit_operator.cli import _leader_election

    monkeypatch.setenv("POD_NAMESPACE", "refit-system")
    monkeypatch.setenv("POD_NAME", "refit-operator-abc12")
    election = _leader_election(build_parser().parse_args(["operator", "--leader-elect"]))
    assert election is not None
    assert (election.namespace, election.name) == ("refit-system", "refit-operator")
    # The pod's name and a random part: a restarted container is a new candidate.
    assert election.identity.startswith("refit-operator-abc12_")
    assert len(election.identity) > len("refit-operator-abc12_") + 30
    assert (
        election.timing.lease_duration,
        election.timing.renew_deadline,
        election.timing.retry_period,
    ) == (15, 10, 2)
    assert _leader_election(build_parser().parse_args(["operator"])) is None
