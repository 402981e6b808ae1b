"""Thin kopf handlers: each parses what kopf hands over and calls the controller.

API and domain errors become kopf's Temporary/Permanent errors in :func:`_mapped`, the one
place where that happens.  Handlers live in a registry built per operator run (no global
state), so tests can run several operators one after another.

Must not render or decide anything (the controller and the pure modules do); this is the
only module, with ``settings``, that imports kopf.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from refit_operator import kube, names
from refit_operator.controller import Controller
from refit_operator.models import GROUP, PLURAL, VERSION, managed_elsewhere
from refit_operator.render import RenderOptions
from refit_operator.settings import OperatorConfig, make_settings


@dataclass
class _Holder:
    controller: Controller | None = None

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


def build_registry(
    config: OperatorConfig,
    connect: Callable[[], kube.Kube] = kube.Kube.connect,
) -> kopf.OperatorRegistry:
    """All handlers of one operator run, registered into a fresh registry."""
    registry = kopf.OperatorRegistry()
    holder = _Holder()
    job = (GROUP, VERSION, PLURAL)
    owned_children = {names.LABEL_JOB: kopf.PRESENT}

    def ours(spec: Mapping[str, Any], **_: Any) -> bool:
        # A job another controller manages (spec.managedBy) gets no handler, so no
        # finalizer, annotation or status from this operator either.
        return not managed_elsewhere(spec)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        # The same credentials as our own client, so kopf and kube.py see one cluster.
        creds = kube.load_credentials()
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

    @kopf.on.startup(registry=registry)
    async def startup(**_: Any) -> None:
        options = RenderOptions(stop_signal_supported=config.stop_signal_supported)
        holder.controller = Controller(connect(), options)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        if holder.controller is not None:
            await holder.controller.close()

    @kopf.on.resume(*job, when=ours, registry=registry)
    @kopf.on.create(*job, when=ours, registry=registry)
    @kopf.on.update(*job, when=ours, registry=registry)
    async def job_changed(*, namespace: str | None, name: str, **_: Any) -> None:
        async with _mapped():
            await holder.get().reconcile(_ns(namespace), name)

    @kopf.timer(
        *job,
        interval=config.resync_seconds,
        initial_delay=config.resync_seconds,
        when=ours,
        registry=registry,
    )
    async def job_resync(*, namespace: str | None, name: str, **_: Any) -> None:
        await holder.get().nudge(_ns(namespace), name)

    @kopf.on.delete(*job, when=ours, registry=registry)
    async def job_deleted(*, namespace: str | None, name: str, **_: Any) -> None:
        async with _mapped():
            await holder.get().delete_pods(_ns(namespace), name)

    @kopf.on.event("v1", "pods", labels=owned_children, registry=registry)
    @kopf.on.event("v1", "configmaps", labels=owned_children, registry=registry)
    async def child_changed(*, namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
        if holder.controller is not None:
            await holder.controller.nudge(_ns(namespace), labels[names.LABEL_JOB])

    @kopf.on.probe(id="reconciles", registry=registry)
    def reconciles(**_: Any) -> int:
        return holder.controller.reconciles if holder.controller is not None else 0

    return registry


def operator_kwargs(
    config: OperatorConfig,
    connect: Callable[[], kube.Kube] = kube.Kube.connect,
) -> dict[str, Any]:
    """Arguments for ``kopf.operator``/``kopf.spawn_tasks`` (tests embed the operator)."""
    return {
        "registry": build_registry(config, connect),
        "settings": make_settings(config),
        "namespaces": list(config.namespaces),
        "clusterwide": not config.namespaces,
        "liveness_endpoint": config.liveness,
        "standalone": True,
    }


def run(config: OperatorConfig) -> Coroutine[Any, Any, None]:
    """The operator as a coroutine for ``asyncio.run``."""
    return kopf.operator(**operator_kwargs(config))
