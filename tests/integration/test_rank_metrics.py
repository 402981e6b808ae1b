"""A worker rank's optional ``/metrics`` (``refit_worker.pod.metrics``): what a scrape shows is
the rank's ProgressLog, read at scrape time; ``REFIT_METRICS_PORT`` is parsed strictly.

Real: prometheus_client's HTTP server on a loopback port, its text parser, an HTTP GET.
Nothing is emulated; no worker process (the endpoint is the same object ``refit-worker``
starts when the variable is set).
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from refit_worker.contract.config import RendezvousConfig, WorkerConfig
from refit_worker.contract.env import metrics_port_from_env
from refit_worker.contract.exits import EXIT_BAD_CONFIG
from refit_worker.contract.progress import ProgressLog
from refit_worker.pod.metrics import RankLabels, serve


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels == {"job": "demo", "role": "rollout", "rank": "1", "epoch": "2"}
            out[sample.name] = sample.value
    return out


def test_a_scrape_shows_the_ranks_progress_log() -> None:
    progress = ProgressLog(first_refit=5)
    exporter = serve(progress, RankLabels("demo", "rollout", 1, 2), port=0, addr="127.0.0.1")
    try:
        before = _scrape(exporter.port)
        assert before == {
            "refit_rank_refits_total": 5,  # resumed at refit 5: counted from the job's start
            "refit_rank_transferred_bytes_total": 0,
            "refit_rank_refit_seconds_total": 0,
        }
        progress.record(5, nbytes=1000, seconds=0.5)
        progress.record(6, nbytes=3000, seconds=1.5)
        assert _scrape(exporter.port) == {
            "refit_rank_refits_total": 7,
            "refit_rank_transferred_bytes_total": 4000,
            "refit_rank_refit_seconds_total": 2.0,
            "refit_rank_last_refit_seconds": 1.5,
            "refit_rank_last_refit_bytes": 3000,
        }
    finally:
        exporter.close()
    with pytest.raises(OSError):
        _scrape(exporter.port)


@pytest.mark.parametrize(
    ("value", "port"), [(None, None), ("", None), (" 9400 ", 9400), ("65535", 65535)]
)
def test_metrics_port_from_env(value: str | None, port: int | None) -> None:
    environ = {} if value is None else {"REFIT_METRICS_PORT": value}
    assert metrics_port_from_env(environ) == port


@pytest.mark.parametrize("value", ["0", "65536", "-1", "http", "80.5"])
def test_a_bad_metrics_port_is_refused_by_name(value: str) -> None:
    with pytest.raises(ValueError, match="REFIT_METRICS_PORT"):
        metrics_port_from_env({"REFIT_METRICS_PORT": value})


def test_refit_worker_exits_2_on_a_bad_port_before_joining_anything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from refit_worker import __main__ as entry

    config = WorkerConfig(
        job="demo",
        role="rollout",
        rank=0,
        policy_world_size=1,
        rollout_world_size=1,
        rendezvous=RendezvousConfig(store="file", location=str(tmp_path)),
        termination_message_path=str(tmp_path / "termination-log"),
    )
    for key, value in config.to_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("REFIT_METRICS_PORT", "ninety")
    monkeypatch.setenv("REFIT_TERMINATION_MESSAGE_PATH", str(tmp_path / "termination-log"))
    monkeypatch.setattr(entry, "run", lambda *a: pytest.fail("run() must not start"))
    assert entry.main([]) == EXIT_BAD_CONFIG
    assert "REFIT_METRICS_PORT" in (tmp_path / "termination-log").read_text()


def test_a_taken_metrics_port_costs_the_metrics_not_the_rank(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Several ranks on one machine (``refit run``) share one ``spec.metrics.port``: the
    first serves it, the others say why they serve nothing and go on refitting."""
    from refit_worker import __main__ as entry

    labels = RankLabels("demo", "rollout", 1, 2)
    first = serve(ProgressLog(0), labels, 0, addr="127.0.0.1")
    try:
        with caplog.at_level("WARNING"):
            second = entry._serve_metrics(ProgressLog(0), labels, first.port, "rollout rank 1")
        assert second is None
        assert f"cannot serve metrics on port {first.port}" in caplog.text
        assert "refit_rank_refits_total" in _scrape(first.port)  # the first still serves
    finally:
        first.close()
