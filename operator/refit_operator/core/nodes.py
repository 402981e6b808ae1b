"""Nodes as the reconcile reads them: a ``Node`` manifest reduced to the facts that say
whether its pods are lost (:class:`NodeFacts`), and the decision itself (:func:`node_lost`).

A pod is lost with its node when the node's ``Ready`` condition has been ``False`` or
``Unknown`` (the node-lifecycle controller's "unreachable") for ``nodeLostSeconds`` or
longer, when the node is tainted ``node.kubernetes.io/out-of-service`` (a person said it
is shut down, as Kubernetes documents for a non-graceful node shutdown), or when the Node
object is gone.  The bound is counted from the condition's ``lastTransitionTime``, the
node-lifecycle controller's own clock, so an operator restart does not start it again.

Pure (``refit_operator.api.spec_basics`` reads the bound of a spec).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from refit_operator.api.spec_basics import NODE_LOST_SECONDS, SpecBasics

#: The taint a person puts on a node that is shut down for good (non-graceful shutdown).
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"
#: ``spec.failurePolicy.nodeLostSeconds`` when the spec does not say.
DEFAULT_NODE_LOST_SECONDS = float(NODE_LOST_SECONDS)
#: Phases in which a pod still holds its place (a finished pod loses nothing with its node).
_LIVE_PHASES = frozenset({"Pending", "Running", "Unknown"})


@dataclass(frozen=True)
class NodeFacts:
    name: str
    #: False: the Node object does not exist (deleted, or never did).
    exists: bool = True
    #: The ``Ready`` condition's status: "True", "False", "Unknown", or None (none posted).
    ready: str | None = "True"
    #: When ``Ready`` last changed (None when the condition or its time is missing).
    since: datetime | None = None
    #: Tainted ``node.kubernetes.io/out-of-service`` (any effect).
    out_of_service: bool = False

    @property
    def healthy(self) -> bool:
        return self.exists and self.ready == "True" and not self.out_of_service


def _time(text: Any) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def node_facts(node: Mapping[str, Any]) -> NodeFacts:
    """What a ``Node`` manifest says about the pods on it."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    taints = (node.get("spec") or {}).get("taints") or []
    return NodeFacts(
        name=str((node.get("metadata") or {}).get("name", "")),
        ready=None if ready is None else str(ready.get("status")),
        since=None if ready is None else _time(ready.get("lastTransitionTime")),
        out_of_service=any(t.get("key") == OUT_OF_SERVICE for t in taints),
    )


def gone_node(name: str) -> NodeFacts:
    """A node the API does not know (404): its pods have nowhere to run."""
    return NodeFacts(name=name, exists=False, ready=None)


def node_lost_seconds(raw_spec: Any) -> float:
    """``spec.failurePolicy.nodeLostSeconds`` of a spec, valid or not, read through
    :class:`~refit_operator.api.spec_basics.SpecBasics` (pods are observed before the spec is
    validated; a bad value is the validation's to refuse, here it means the default)."""
    return SpecBasics.read(raw_spec).node_lost_seconds


def not_ready_for(facts: NodeFacts, now: datetime) -> float | None:
    """Seconds the node has been not ready (None: it is ready, or it cannot be told)."""
    if facts.ready == "True" or facts.since is None:
        return None
    return max(0.0, (now - facts.since).total_seconds())


def node_lost(facts: NodeFacts | None, now: datetime, bound: float) -> str | None:
    """Why a pod on this node is lost with it, or None while it is not (yet)."""
    if facts is None or facts.healthy:
        return None
    if not facts.exists:
        return f"node {facts.name} no longer exists"
    if facts.out_of_service:
        return f"node {facts.name} is out of service"
    state = "NotReady" if facts.ready == "False" else "unreachable (Ready Unknown)"
    if facts.ready is None:
        state = "without a Ready condition"
    elapsed = not_ready_for(facts, now)
    if elapsed is None:
        # No transition time to count from: the bound cannot be waited out, so it is over.
        return f"node {facts.name} {state} since an unknown time"
    if elapsed < bound:
        return None
    return f"node {facts.name} {state} for {int(elapsed)}s"


def describe(facts: NodeFacts) -> str:
    """The node's state in words that stay the same from round to round (an Event's
    message: a repeat joins its series instead of adding another Event)."""
    if not facts.exists:
        return f"node {facts.name} no longer exists"
    if facts.out_of_service:
        return f"node {facts.name} is out of service ({OUT_OF_SERVICE})"
    if facts.ready == "True":
        return f"node {facts.name} is Ready"
    state = {"False": "NotReady", None: "without a Ready condition"}.get(
        facts.ready, "unreachable (Ready Unknown)"
    )
    since = facts.since.isoformat().replace("+00:00", "Z") if facts.since else "an unknown time"
    return f"node {facts.name} {state} since {since}"


def lost_after(facts: NodeFacts | None, now: datetime, bound: float) -> float | None:
    """Seconds until a pod on this node is lost, while the node is not ready and the bound
    not yet over (None otherwise): when the reconcile must look again unprompted."""
    if facts is None or facts.healthy:
        return None
    elapsed = not_ready_for(facts, now)
    if elapsed is None or elapsed >= bound or facts.out_of_service:
        return None
    return bound - elapsed


def holds_place(phase: str) -> bool:
    """Whether a pod in ``phase`` loses anything with its node."""
    return phase in _LIVE_PHASES
