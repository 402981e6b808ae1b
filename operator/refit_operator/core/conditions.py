"""Status conditions as ``metav1.Condition``: set one, keeping its transition time when its
status is unchanged; every condition carries a reason and the generation it was set for.

Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Literal

from refit_operator.api.models import Condition

READY = "Ready"
COMPLETE = "Complete"
FAILED = "Failed"
SUSPENDED = "Suspended"
#: True while a gang is stopped and recreated (after a failure, preemption or spec change).
RESTARTING = "Restarting"
RENDEZVOUS = "RendezvousReadable"
#: True while fewer rollout replicas serve (Ready) than ``rollout.replicas`` asks.
ROLLOUT_DEGRADED = "RolloutDegraded"
#: Every rank of the epoch published its metadata and the barrier is open.
CONNECTED = "Connected"
#: True while the apiserver refuses a write of a child (create, delete, patch): the reason
#: is the apiserver's (Forbidden, Invalid, ...), the message its text.
CHILD_FAILURE = "ChildFailure"

Truth = Literal["True", "False", "Unknown"]


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: Truth,
    *,
    reason: str,
    message: str,
    now: datetime,
    generation: int = 0,
) -> list[Condition]:
    """Return ``conditions`` with ``type_`` set; lastTransitionTime moves only on a change."""
    old = get_condition(conditions, type_)
    when = old.last_transition_time if old is not None and old.status == status else now
    new = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message[:32768],
        last_transition_time=when,
        observed_generation=generation,
    )
    out = [c for c in conditions if c.type != type_] + [new]
    return sorted(out, key=lambda c: c.type)


def get_condition(conditions: Sequence[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)
