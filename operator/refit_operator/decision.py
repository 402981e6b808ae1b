"""What a reconcile round decides, as data: the actions, the job it looked at, the
decision, and the mutable scratch of one round.

Must not import: kopf, kubernetes, aiohttp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, TypeAlias

from refit_operator import conditions as cond
from refit_operator import render
from refit_operator.coordinate import PatchData
from refit_operator.models import RefitJobStatus


@dataclass(frozen=True)
class Create:
    obj: dict[str, Any]


@dataclass(frozen=True)
class Delete:
    api_version: str
    kind: str
    name: str


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
    ref: render.JobRef
    generation: int
    raw_spec: Any
    status: RefitJobStatus


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    status: RefitJobStatus
    requeue_after: float | None = None
    #: Another controller manages the job (``spec.managedBy``): write nothing at all.
    hands_off: bool = False


@dataclass
class Round:
    """Mutable scratch of one reconcile round."""

    status: RefitJobStatus
    generation: int
    now: datetime
    actions: list[Action] = field(default_factory=list)
    requeue: float | None = None
    #: The Failed condition's reason, when this round fails the job.
    failed_reason: str = "RestartsExhausted"
    #: What a Pending job waits for (late pods and why), for its message.
    waiting: str = ""

    def update(self, **changes: Any) -> None:
        self.status = self.status.model_copy(update=changes)

    def later(self, seconds: float) -> None:
        self.requeue = seconds if self.requeue is None else min(self.requeue, seconds)

    def condition(self, type_: str, status: cond.Truth, reason: str, message: str = "") -> None:
        conditions = cond.set_condition(
            self.status.conditions,
            type_,
            status,
            reason=reason,
            message=message,
            now=self.now,
            generation=self.generation,
        )
        self.update(conditions=conditions)
