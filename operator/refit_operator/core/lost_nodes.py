"""What the reconcile does about pods on lost nodes, whatever its policy steps decided: a
``NodeLost`` Event naming the node, a force delete (grace 0, uid precondition) of every
pod on a node tainted ``node.kubernetes.io/out-of-service`` (as Kubernetes documents for a
non-graceful node shutdown: nothing else will ever remove them), and a look again when a
pod's node is not ready but its bound is not over yet (a node going quiet changes no pod,
so no watch event would wake the operator).

Whether a lost pod is replaced, or its gang restarted, is the steps' decision
(``ObservedPod.node_lost``); this module only observes and deletes.

Pure.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from refit_operator.core.decision import Delete, Emit
from refit_operator.core.draft import Draft
from refit_operator.core.nodes import describe, lost_after
from refit_operator.core.observe import Observed, ObservedPod

#: How often a round looks again while pods sit on a lost node (an out-of-service taint
#: or the node's return changes no pod of the job).
NODE_RECHECK_S = 15.0
#: Never sooner than this after the bound (the node-lifecycle controller's clock and ours).
_MIN_WAIT_S = 0.5
REASON = "NodeLost"


def force_deletes(observed: Observed) -> list[Delete]:
    """Every pod on an out-of-service node, already deleting or not (a pod stuck
    Terminating there is exactly the one to remove)."""
    return [
        Delete("v1", "Pod", p.name, grace_period_seconds=0, uid=p.uid)
        for p in observed.pods
        if p.node is not None
        and (facts := observed.nodes.get(p.node)) is not None
        and facts.out_of_service
    ]


def node_events(observed: Observed, current: Collection[str] = ()) -> list[Emit]:
    """One Warning per lost node naming the pods of the job lost with it.

    ``current``: the names of the pods the job still counts on (the epoch's policy pods,
    the rollout slots' pods).  Such a pod is announced even when it is already deleting:
    kube-controller-manager's taint eviction (a ``tolerationSeconds`` as short as
    ``nodeLostSeconds``) may delete it before the round that finds it lost.  Any other
    pod is announced only while not deleting, since the round that replaced it (or
    deleted it) announced it.
    """
    counted = set(current)
    by_node: dict[str, list[ObservedPod]] = {}
    for pod in observed.pods:
        if pod.node_lost and pod.node is not None and (not pod.deleting or pod.name in counted):
            by_node.setdefault(pod.node, []).append(pod)
    events = []
    for node, pods in sorted(by_node.items()):
        facts = observed.nodes[node]
        bound = f"{observed.node_lost_seconds:g}"
        events.append(
            Emit(
                "Warning",
                REASON,
                f"{describe(facts)} (nodeLostSeconds {bound}): pods {_names(pods)} are lost",
            )
        )
    return events


def recheck_after(observed: Observed) -> float | None:
    """When to look again unprompted: at the end of a not-ready node's bound, and every
    :data:`NODE_RECHECK_S` while a pod of the job sits on a lost node."""
    waits: list[float] = []
    now = None
    for pod in observed.pods:
        facts = observed.nodes.get(pod.node) if pod.node is not None else None
        if facts is None or facts.healthy:
            continue
        if pod.node_lost is not None:
            waits.append(NODE_RECHECK_S)
            continue
        now = now or observed.observed_at
        if now is None:
            continue
        left = lost_after(facts, now, observed.node_lost_seconds)
        if left is not None:
            waits.append(max(_MIN_WAIT_S, left))
    return min(waits) if waits else None


def act(observed: Observed, draft: Draft, current: Collection[str] = ()) -> None:
    """Add the force deletes, the Events and the look again to the round's draft; a
    plain delete of a pod that is force-deleted is dropped.  ``current``: as for
    :func:`node_events`."""
    forced = force_deletes(observed)
    if forced:
        names = {d.name for d in forced}
        draft.actions[:] = [
            a
            for a in draft.actions
            if not (isinstance(a, Delete) and a.kind == "Pod" and a.name in names)
        ]
        draft.actions.extend(forced)
    draft.actions.extend(node_events(observed, current))
    wait = recheck_after(observed)
    if wait is not None:
        draft.later(wait)


def _names(pods: Iterable[ObservedPod]) -> str:
    return ", ".join(sorted(p.name for p in pods))
