"""Kubernetes-style status conditions: set one, keeping its transition time when unchanged.

Pure; must not import kopf or kubernetes.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Literal

from refit_operator.models import Condition

READY = "Ready"
COMPLETE = "Complete"
FAILED = "Failed"
SUSPENDED = "Suspended"
RESTARTING = "Restarting"
RENDEZVOUS = "RendezvousReadable"
#: Every rank of the epoch published its metadata and the barrier is open.
CONNECTED = "Connected"

Truth = Literal["True", "False", "Unknown"]


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: Truth,
    *,
    reason: str,
    message: str,
    now: datetime,
) -> list[Condition]:
    """Return ``conditions`` with ``type_`` set; lastTransitionTime moves only on a change."""
    old = get_condition(conditions, type_)
    when = old.last_transition_time if old is not None and old.status == status else now
    new = Condition(
        type=type_, status=status, reason=reason, message=message, last_transition_time=when
    )
    out = [c for c in conditions if c.type != type_] + [new]
    return sorted(out, key=lambda c: c.type)


def get_condition(conditions: Sequence[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)
