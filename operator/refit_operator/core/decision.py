"""What a reconcile round decides, as data: the actions, the job it looked at, and the
decision (the actions and the status to write).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, TypeAlias

from refit_operator.api.models import RefitJobStatus, SpecBasics
from refit_operator.core.coordinate import PatchData
from refit_operator.render import pods


@dataclass(frozen=True)
class Create:
    obj: dict[str, Any]


@dataclass(frozen=True)
class Delete:
    """Delete a child; ``grace_period_seconds=0`` with ``uid`` is a force delete of that
    very pod (one on an out-of-service node), not of a successor of the same name."""

    api_version: str
    kind: str
    name: str
    grace_period_seconds: int | None = None
    uid: str | None = None


@dataclass(frozen=True)
class Emit:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class LiftGate:
    """Take the gang's scheduling gate off a pod: ``gates`` are the ones it keeps; the
    write is conditional on ``resource_version`` (a pod changed since is looked at again)."""

    name: str
    gates: tuple[str, ...]
    resource_version: str


@dataclass(frozen=True)
class DeleteJob:
    """Delete the RefitJob itself (its TTL after finishing ran out); its children follow
    by their ownerReferences."""


Action: TypeAlias = Create | Delete | PatchData | Emit | LiftGate | DeleteJob


@dataclass(frozen=True)
class JobView:
    ref: pods.JobRef
    generation: int
    raw_spec: Any
    status: RefitJobStatus

    @cached_property
    def basics(self) -> SpecBasics:
        """What is read of the spec, valid or not (managed by, TTL, node-lost bound):
        read once, through the models."""
        return SpecBasics.read(self.raw_spec)


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    status: RefitJobStatus
    requeue_after: float | None = None
    #: Another controller manages the job (``spec.managedBy``): write nothing at all.
    hands_off: bool = False
