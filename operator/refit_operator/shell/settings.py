"""Operator configuration (from the CLI) and the kopf settings derived from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import kopf

from refit_operator.shell.lease import Timing

#: The finalizer operators before 0.2 put on every RefitJob.  No handler needs one now
#: (children go by ownerReference), so kopf removes it from each job it meets; it stays
#: named here so kopf recognises it as its own.
FINALIZER = "refit.dev/finalizer"
ANNOTATION_PREFIX = "refit.dev"


@dataclass(frozen=True, kw_only=True)
class LeaderElection:
    """Where the replicas' Lease lives, who this replica is, and the Lease's timing."""

    namespace: str
    name: str = "refit-operator"
    identity: str
    timing: Timing = field(default_factory=Timing)


@dataclass(frozen=True, kw_only=True)
class OperatorConfig:
    """What the operator process is told at start-up."""

    #: Namespaces to serve; empty means cluster-wide.
    namespaces: tuple[str, ...] = ()
    #: The cluster honours ``lifecycle.stopSignal`` (k8s >= 1.33, ContainerStopSignals).
    stop_signal_supported: bool = False
    #: Periodic full reconcile of every job, a safety net for missed events.
    resync_seconds: float = 60.0
    #: ``HOST:PORT`` of ``/healthz`` and ``/readyz``; None: not served.
    health: str | None = None
    #: ``HOST:PORT`` of ``/metrics`` (may equal ``health``); None: not served.
    metrics: str | None = None
    #: None: this replica reconciles alone, without a Lease.
    leader_election: LeaderElection | None = None


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
    # Only the replica that holds the leader Lease runs kopf at all (``runtime``); kopf's
    # peering would only pause lower-priority peers, so it stays off.
    settings.peering.standalone = True
    # We post our own Events; kopf's per-handler ones would only add noise.
    settings.posting.enabled = False
    # Namespaces are given explicitly; no need to scan (or be allowed to list) them all.
    settings.scanning.disabled = True
    return settings
