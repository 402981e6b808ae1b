"""Thin kopf handlers: each parses what kopf hands over and calls the controller.

API and domain errors become kopf's Temporary/Permanent errors in :func:`_mapped`, the one
place where that happens.  Handlers live in a registry built per operator run (no global
state), so tests can run several operators one after another.

No handler needs a finalizer: a RefitJob's children go with it by ownerReference (the
garbage collector), so deleting a job never waits for an operator.  A deletion seen by
the operator only stops the gang sooner.  Hence no ``on.delete`` handler and no
``kopf.timer`` (kopf puts a finalizer on objects that have either); the periodic resync
is a loop of the operator's own (:func:`_resync`), whose first full listing makes the
operator ready.

Nothing here renders or decides (the controller and the pure layers do).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from refit_operator.api import names
from refit_operator.api.models import GROUP, PLURAL, VERSION, managed_elsewhere
from refit_operator.render.pods import RenderOptions
from refit_operator.shell import credentials, kube
from refit_operator.shell.controller import Controller
from refit_operator.shell.metrics import OperatorMetrics
from refit_operator.shell.settings import OperatorConfig, make_settings

log = logging.getLogger(__name__)
#: Retry delay of a failed resync listing (the first one decides readiness).
RESYNC_RETRY_S = 5.0


def _no_guard() -> None:
    """Reconcile always: no leader election."""


@dataclass
class ProcessContext:
    """What the handlers share with the process that runs them (``runtime``): metrics,
    the leader guard, whether the jobs were listed, the Events' reporting instance."""

    metrics: OperatorMetrics | None = None
    #: Checked before every reconcile round (a lost Lease ends the process there).
    guard: Callable[[], None] = _no_guard
    #: The RefitJobs have been listed once since the operator started.
    listed: bool = False
    #: ``reportingInstance`` of the operator's Events (the pod's name); "" for the host's.
    instance: str = ""


@dataclass
class _Holder:
    controller: Controller | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def get(self) -> Controller:
        if self.controller is None:
            raise kopf.TemporaryError("the operator is still starting", delay=1)
        return self.controller


@asynccontextmanager
async def _mapped() -> Any:
    """Map errors of one handler call to kopf's retry semantics."""
    try:
        yield
    except kube.ConflictError as exc:
        raise kopf.TemporaryError(f"write conflict, retrying: {exc}", delay=1) from exc
    except kube.ApiError as exc:
        if exc.status in (400, 403, 422):
            raise kopf.PermanentError(str(exc)) from exc
        raise kopf.TemporaryError(str(exc), delay=5) from exc
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise kopf.TemporaryError(f"API unreachable: {exc!r}", delay=5) from exc


def _ns(namespace: str | None) -> str:
    if namespace is None:  # RefitJobs and their children are namespaced
        raise kopf.PermanentError("a RefitJob event came without a namespace")
    return namespace


async def _resync(controller: Controller, config: OperatorConfig, shared: ProcessContext) -> None:
    """List every served namespace's RefitJobs and reconcile each, every resync period:
    a safety net for missed events.  The first listing that succeeds makes us ready; it
    reconciles nothing itself, as kopf's resume handlers start every job it finds."""
    namespaces: tuple[str | None, ...] = config.namespaces or (None,)
    while True:
        try:
            count = await controller.resync(namespaces, nudge=shared.listed)
        except (kube.ApiError, TimeoutError, aiohttp.ClientError) as exc:
            log.warning("listing RefitJobs failed (%s); again in %.0f s", exc, RESYNC_RETRY_S)
            await asyncio.sleep(min(RESYNC_RETRY_S, config.resync_seconds))
            continue
        if not shared.listed:
            log.info("listed %d RefitJob(s); the operator is ready", count)
            shared.listed = True
        await asyncio.sleep(config.resync_seconds)


def build_registry(
    config: OperatorConfig,
    connect: Callable[[], kube.Kube] = kube.Kube.connect,
    shared: ProcessContext | None = None,
) -> kopf.OperatorRegistry:
    """All handlers of one operator run, registered into a fresh registry."""
    registry = kopf.OperatorRegistry()
    holder = _Holder()
    context = shared if shared is not None else ProcessContext()
    kopf.on.login(registry=registry)(_login)
    _register_process(registry, holder, config, connect, context)
    _register_jobs(registry, holder)
    return registry


def _login(**_: Any) -> kopf.ConnectionInfo:
    """The same credentials as our own client, so kopf and kube.py see one cluster."""
    creds = credentials.load_credentials()
    scheme, _sep, token = creds.headers().get("Authorization", "").partition(" ")
    return kopf.ConnectionInfo(
        server=creds.server,
        ca_path=creds.ca_path,
        insecure=not creds.verify,
        scheme=scheme or None,
        token=token or None,
        certificate_path=creds.cert_path,
        private_key_path=creds.key_path,
    )


def _register_process(
    registry: kopf.OperatorRegistry,
    holder: _Holder,
    config: OperatorConfig,
    connect: Callable[[], kube.Kube],
    context: ProcessContext,
) -> None:
    """Start-up (the controller and the periodic resync) and clean-up."""

    @kopf.on.startup(registry=registry)
    async def startup(**_: Any) -> None:
        options = RenderOptions(stop_signal_supported=config.stop_signal_supported)
        api = connect()
        if context.metrics is not None:
            api.on_error = context.metrics.api_error
        if context.instance:
            api.recorder.instance = context.instance
        controller = Controller(api, options, metrics=context.metrics, guard=context.guard)
        holder.controller = controller
        task = asyncio.get_running_loop().create_task(_resync(controller, config, context))
        holder.tasks.add(task)
        task.add_done_callback(holder.tasks.discard)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        for task in list(holder.tasks):
            task.cancel()
        if holder.controller is not None:
            await holder.controller.close()


def _register_jobs(registry: kopf.OperatorRegistry, holder: _Holder) -> None:
    """The RefitJobs' own events and their children's."""
    job = (GROUP, VERSION, PLURAL)
    owned_children = {names.LABEL_JOB: kopf.PRESENT}

    def ours(spec: Mapping[str, Any], **_: Any) -> bool:
        # A job another controller manages (spec.managedBy) gets no handler, so no
        # annotation or status from this operator either.
        return not managed_elsewhere(spec)

    @kopf.on.resume(*job, when=ours, registry=registry)
    @kopf.on.create(*job, when=ours, registry=registry)
    @kopf.on.update(*job, when=ours, registry=registry)
    async def job_changed(*, namespace: str | None, name: str, **_: Any) -> None:
        async with _mapped():
            await holder.get().reconcile(_ns(namespace), name)

    @kopf.on.event(*job, registry=registry)
    async def job_event(
        *, event: Mapping[str, Any], namespace: str | None, name: str, **_: Any
    ) -> None:
        if event.get("type") != "DELETED" or holder.controller is None:
            return
        try:
            await holder.controller.delete_pods(_ns(namespace), name)
        except (kube.ApiError, TimeoutError, aiohttp.ClientError) as exc:
            # The garbage collector deletes them anyway; we were only quicker.
            log.warning("could not stop the gang of deleted job %s/%s: %s", namespace, name, exc)

    @kopf.on.event("v1", "pods", labels=owned_children, registry=registry)
    @kopf.on.event("v1", "configmaps", labels=owned_children, registry=registry)
    async def child_changed(*, namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
        if holder.controller is not None:
            await holder.controller.nudge(_ns(namespace), labels[names.LABEL_JOB])


def operator_kwargs(
    config: OperatorConfig,
    connect: Callable[[], kube.Kube] = kube.Kube.connect,
    shared: ProcessContext | None = None,
) -> dict[str, Any]:
    """Arguments for ``kopf.operator``/``kopf.spawn_tasks`` (tests embed the operator)."""
    return {
        "registry": build_registry(config, connect, shared),
        "settings": make_settings(config),
        "namespaces": list(config.namespaces),
        "clusterwide": not config.namespaces,
        "standalone": True,
    }
