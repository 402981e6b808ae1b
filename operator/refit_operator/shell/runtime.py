"""One operator process: its endpoints, its leader election, and kopf once it may lead.

1. ``/healthz``, ``/readyz`` and ``/metrics`` are served from the start (``endpoints``).
2. With leader election, the replica is a **standby** until it holds the Lease: it runs no
   kopf, watches nothing, reconciles nothing; it only reads the Lease every retry period.
   A standby is ready while the API answers it (it can take over), so a Deployment's
   rolling update and PodDisruptionBudget count it.
3. Once it holds the Lease (or at once without election), kopf starts; the replica is
   ready once it has listed the RefitJobs it serves (``handlers._resync``).
4. A lost Lease ends the process at once with :data:`EXIT_LEASE_LOST`, before any other
   replica may take the Lease (the controller-runtime convention): nothing of the old
   leader's work can interleave with the new one's.  The Deployment restarts it as a
   standby.  A clean stop (SIGTERM) gives the Lease up, so a standby takes over at its
   next try instead of after a lease duration.

Decides nothing about RefitJobs (``controller`` and the pure layers do).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import kopf

from refit_operator.shell import kube
from refit_operator.shell.endpoints import Address, Endpoints
from refit_operator.shell.handlers import ProcessContext, operator_kwargs
from refit_operator.shell.leader import Elector, LeaseLost
from refit_operator.shell.metrics import OperatorMetrics
from refit_operator.shell.settings import OperatorConfig

log = logging.getLogger(__name__)

#: The exit code of a replica that lost the leader Lease (its restart makes it a standby).
EXIT_LEASE_LOST = 3


def exit_now(reason: str) -> None:
    """Stop reconciling at once: end the process without running anything else."""
    log.critical("leader election lost: %s; exiting so that only one replica reconciles", reason)
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_LEASE_LOST)


@dataclass
class Runtime:
    """The state ``/readyz`` reads."""

    shared: ProcessContext
    elector: Elector | None = None

    def ready(self) -> str | None:
        """None when ready, else why not."""
        elector = self.elector
        if elector is not None and not elector.leading:
            if elector.in_touch():
                return None  # a standby that can take over
            return "a standby that has not reached the API within a lease duration"
        if not self.shared.listed:
            return "the RefitJobs have not been listed yet"
        return None


async def run(
    config: OperatorConfig,
    *,
    connect: Callable[[], kube.Kube] = kube.Kube.connect,
    on_lost: Callable[[str], None] = exit_now,
) -> None:
    """Run one operator replica until it is stopped (SIGTERM/SIGINT) or loses the Lease."""
    metrics = OperatorMetrics()
    shared = ProcessContext(metrics=metrics)
    runtime = Runtime(shared)
    endpoints = Endpoints(
        health=Address.parse(config.health) if config.health else None,
        metrics=Address.parse(config.metrics) if config.metrics else None,
        ready=runtime.ready,
        registry=metrics.registry,
    )
    await endpoints.start()
    try:
        with _stop_on_signals() as stop:
            if config.leader_election is None:
                metrics.set_leader(True)
                await kopf.operator(**operator_kwargs(config, connect, shared), stop_flag=stop)
            else:
                await _elected(config, connect, on_lost, runtime, metrics=metrics, stop=stop)
    finally:
        metrics.set_leader(False)
        await endpoints.stop()


async def _elected(
    config: OperatorConfig,
    connect: Callable[[], kube.Kube],
    on_lost: Callable[[str], None],
    runtime: Runtime,
    *,
    metrics: OperatorMetrics,
    stop: asyncio.Event,
) -> None:
    """A standby until the Lease is ours, then kopf; the Lease is given up on the way out."""
    election = config.leader_election
    assert election is not None
    shared = runtime.shared
    api = connect()
    api.on_error = metrics.api_error
    elector = Elector(
        api,
        namespace=election.namespace,
        name=election.name,
        identity=election.identity,
        timing=election.timing,
    )
    runtime.elector = elector
    shared.instance = election.identity.partition("_")[0]
    holding: asyncio.Task[None] | None = None
    try:
        if not await _until_stopped(elector.acquire(), stop):
            return  # stopped while a standby
        holding = asyncio.get_running_loop().create_task(elector.hold())
        holding.add_done_callback(lambda task: _lost(task, on_lost))

        def guard() -> None:
            if not elector.valid():
                on_lost("the Lease is no longer held, or not renewed in time")

        shared.guard = guard
        metrics.set_leader(True)
        await kopf.operator(**operator_kwargs(config, connect, shared), stop_flag=stop)
    finally:
        if holding is not None:
            holding.cancel()  # a cancelled renew loop is a clean stop, not a loss
            with contextlib.suppress(asyncio.CancelledError, LeaseLost):
                await holding
        await elector.release()
        await api.close()


def _lost(task: asyncio.Task[None], on_lost: Callable[[str], None]) -> None:
    if task.cancelled():
        return  # a clean stop: the Lease is released, not lost
    error = task.exception()
    on_lost(str(error) if error is not None else "the renew loop ended")


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[asyncio.Event]:
    """An event SIGTERM/SIGINT set, from the process's first await to its last.  kopf
    installs its own handlers once it runs and also watches this event (``stop_flag``), so a
    signal that lands between the Lease's acquisition and kopf's start is not the default
    action (death without giving the Lease up) but a stop kopf sees at once."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in signals:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)


async def _until_stopped(work: Awaitable[None], stop: asyncio.Event) -> bool:
    """Run ``work`` until it ends (True) or ``stop`` is set (False)."""
    loop = asyncio.get_running_loop()
    task = loop.create_task(_awaited(work))
    stopping = loop.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    log.info("stopped while a standby")
    return False


async def _awaited(work: Awaitable[None]) -> None:
    await work
