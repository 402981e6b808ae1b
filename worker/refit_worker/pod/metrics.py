"""A rank's refit figures for Prometheus: ``/metrics`` on a port of the worker's own.

Optional: ``refit-worker`` serves them when ``REFIT_METRICS_PORT`` is set (the operator
sets it, and a ``containerPort`` named ``metrics``, from the RefitJob's ``metrics.port``);
a user's own loop calls :func:`serve` with its
:class:`~refit_worker.contract.progress.ProgressLog`.
The figures are read from that log at scrape time, so they are exactly what the rank
reports under its ``progress.<role>.<rank>`` key.  The operator's own metrics cover the
whole job; these are per rank, for a look inside a slow or stuck gang.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from refit_worker.contract.progress import ProgressLog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankLabels:
    job: str
    role: str
    rank: int
    epoch: int

    def values(self) -> list[str]:
        return [self.job, self.role, str(self.rank), str(self.epoch)]


class _RankCollector(Collector):
    def __init__(self, progress: ProgressLog, labels: RankLabels) -> None:
        self._progress, self._labels = progress, labels

    def collect(self) -> Iterator[Metric]:
        names = ["job", "role", "rank", "epoch"]
        values = self._labels.values()
        p = self._progress
        refits = CounterMetricFamily(
            "refit_rank_refits",
            "Refits this rank committed (rollout) or sent (policy), counted from the job's start.",
            labels=names,
        )
        refits.add_metric(values, p.refits_completed)
        moved = CounterMetricFamily(
            "refit_rank_transferred_bytes", "Bytes this rank moved in this epoch.", labels=names
        )
        moved.add_metric(values, p.bytes_total)
        seconds = CounterMetricFamily(
            "refit_rank_refit_seconds",
            "Seconds this rank spent in refits this epoch.",
            labels=names,
        )
        seconds.add_metric(values, p.seconds_total)
        yield from (refits, moved, seconds)
        if p.recent:
            last = p.recent[-1]
            last_seconds = GaugeMetricFamily(
                "refit_rank_last_refit_seconds", "Seconds of this rank's last refit.", labels=names
            )
            last_seconds.add_metric(values, last.seconds)
            last_bytes = GaugeMetricFamily(
                "refit_rank_last_refit_bytes", "Bytes of this rank's last refit.", labels=names
            )
            last_bytes.add_metric(values, last.bytes)
            yield from (last_seconds, last_bytes)


class RankMetrics:
    """A running ``/metrics`` endpoint; :meth:`close` stops it."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve(
    progress: ProgressLog, labels: RankLabels, port: int, addr: str = "0.0.0.0"
) -> RankMetrics:
    """Serve ``progress`` on ``addr:port`` (0: any free port) from a daemon thread."""
    registry = CollectorRegistry()
    registry.register(_RankCollector(progress, labels))
    server, thread = start_http_server(port, addr=addr, registry=registry)
    metrics = RankMetrics(server, thread)
    log.info("serving this rank's metrics on %s:%d/metrics", addr, metrics.port)
    return metrics
