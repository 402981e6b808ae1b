"""Operator configuration (from the CLI) and the kopf settings derived from it.

Must not be imported by the pure modules; imports kopf.
"""

from __future__ import annotations

from dataclasses import dataclass

import kopf

FINALIZER = "refit.dev/finalizer"
ANNOTATION_PREFIX = "refit.dev"


@dataclass(frozen=True, kw_only=True)
class OperatorConfig:
    """What the operator process is told at start-up."""

    #: Namespaces to serve; empty means cluster-wide.
    namespaces: tuple[str, ...] = ()
    #: The cluster honours ``lifecycle.stopSignal`` (k8s >= 1.33, ContainerStopSignals).
    stop_signal_supported: bool = False
    #: Periodic full reconcile of every job, a safety net for missed events.
    resync_seconds: float = 60.0
    #: e.g. ``http://0.0.0.0:8080/healthz``; None: no liveness endpoint.
    liveness: str | None = None


def make_settings(config: OperatorConfig) -> kopf.OperatorSettings:
    """kopf settings with our own finalizer and annotation prefix."""
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    # One replica (the chart's Deployment uses Recreate), so no peering CRD is needed.
    settings.peering.standalone = True
    # We post our own Events; kopf's per-handler ones would only add noise.
    settings.posting.enabled = False
    # Namespaces are given explicitly; no need to scan (or be allowed to list) them all.
    settings.scanning.disabled = True
    return settings
