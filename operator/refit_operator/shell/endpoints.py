"""The operator's HTTP endpoints for the kubelet and Prometheus: ``/healthz``, ``/readyz``
and ``/metrics``, served from the operator's own event loop (so a blocked loop fails the
liveness probe, as it should).

``/healthz`` answers 200 while the process serves; ``/readyz`` answers 200 once the
readiness check passes (the check is the caller's: see ``handlers.Runtime.ready``) and 503
with the reason otherwise; ``/metrics`` is the process's Prometheus registry.  Health and
metrics may share one address or use two.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler

log = logging.getLogger(__name__)

#: A readiness check: None when ready, else why not (the body of the 503).
Readiness = Callable[[], str | None]


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Address:
        """``HOST:PORT`` or ``:PORT`` (every interface); a clear ``ValueError`` otherwise."""
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{text!r} is not HOST:PORT (or :PORT) with a port in 1-65535")
        return cls(host.strip("[]") or "0.0.0.0", int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


async def _healthz(_: web.Request) -> web.StreamResponse:
    return web.Response(text="ok\n")


def _readyz(ready: Readiness) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(_: web.Request) -> web.StreamResponse:
        why = ready()
        if why is None:
            return web.Response(text="ok\n")
        return web.Response(status=503, text=f"not ready: {why}\n")

    return handler


class Endpoints:
    """The probe and metrics servers; :meth:`start` binds, :meth:`stop` closes."""

    def __init__(
        self,
        *,
        health: Address | None,
        metrics: Address | None,
        ready: Readiness,
        registry: CollectorRegistry,
    ) -> None:
        self._apps: dict[Address, web.Application] = {}
        if health is not None:
            app = self._app(health)
            app.router.add_get("/healthz", _healthz)
            app.router.add_get("/readyz", _readyz(ready))
        if metrics is not None:
            self._app(metrics).router.add_get("/metrics", make_aiohttp_handler(registry))
        self._runners: list[web.AppRunner] = []

    def _app(self, address: Address) -> web.Application:
        return self._apps.setdefault(address, web.Application())

    async def start(self) -> None:
        for address, app in self._apps.items():
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            self._runners.append(runner)
            await web.TCPSite(runner, address.host, address.port).start()
            log.info("serving %s on %s", ", ".join(_paths(app)), address)

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()


def _paths(app: web.Application) -> list[str]:
    return sorted({r.resource.canonical for r in app.router.routes() if r.resource is not None})
