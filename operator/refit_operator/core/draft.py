"""The one thing a reconcile round builds up as its steps run: the :class:`Draft` of its
decision (the status so far, the actions, when to look again).

Every step reads the job's status from ``draft.status`` only, never from a copy taken
earlier, so a value a step wrote is the value the next step sees.  What the round
observed is in :class:`~refit_operator.core.round_input.RoundInput`, which no step changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from refit_operator.api.models import RefitJobStatus
from refit_operator.core import conditions as cond
from refit_operator.core.decision import Action, Decision, Delete
from refit_operator.core.failure import Failure
from refit_operator.core.observe import ObservedPod


@dataclass
class Draft:
    """The decision being built: the status so far, the actions so far."""

    status: RefitJobStatus
    generation: int
    now: datetime
    actions: list[Action] = field(default_factory=list)
    requeue: float | None = None
    #: Why this round fails the job (None: it does not, or no step said why).
    failure: Failure | None = None
    #: What a Pending job waits for (late pods and why), for its message.
    waiting: str = ""

    def update(self, **changes: Any) -> None:
        self.status = self.status.model_copy(update=changes)

    def later(self, seconds: float) -> None:
        """Look again in ``seconds`` at the latest (the soonest wish wins)."""
        self.requeue = seconds if self.requeue is None else min(self.requeue, seconds)

    def fail(self, reason: str, message: str) -> None:
        """This round fails the job, for the reason and in the words given: the end of
        the round (``closing.py``) writes them to the status and the Failed condition."""
        self.failure = Failure(reason, message)
        self.update(message=message, completion_time=self.now)

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

    def delete_pods(self, pods: Iterable[ObservedPod]) -> None:
        """Delete each pod not already going away."""
        self.actions.extend(Delete("v1", "Pod", p.name) for p in pods if not p.deleting)

    def decision(self) -> Decision:
        return Decision(tuple(self.actions), self.status, self.requeue)
