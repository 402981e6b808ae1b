"""Whose word a preemption is taken on: the platform's, or the operator's own notice.

A pod is preempted when the platform says so: its ``DisruptionTarget`` condition, its
deletion, an eviction, its node lost, or its going missing.  A worker's own word (its exit
code ``EXIT_PREEMPTED``, its rank's progress reporting ``preempted``) is believed only as
the knock-on of such a preemption: one attested in the same gang (the ranks' signal
handler stops them together), or the operator's own notice for the epoch, in its map,
which no worker may write.  Any other claim would let a taken-over pod restart its gang
without end, each time free of ``maxRestarts``; it is ignored with a Warning Event that
names the pod (:data:`IGNORED`).  A pod that exited on such a claim failed, and is counted
as the failure it is; one that still runs goes on.

Pure: observed state in, pods and Events out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from refit_operator.core.decision import Emit
from refit_operator.core.observe import ObservedPod
from refit_worker.contract.exits import EXIT_PREEMPTED
from refit_worker.contract.rendezvous import PreemptNotice, ProgressEntry

#: The reason of the Warning Event about a preemption no one attested.
IGNORED = "PreemptionNoticeIgnored"


@dataclass(frozen=True)
class Vetted:
    """The round's pods with every unattested claim taken for what it is, and the Events
    that say which claims were ignored."""

    pods: tuple[ObservedPod, ...]
    events: tuple[Emit, ...] = ()


def attested(pod: ObservedPod) -> bool:
    """The platform says ``pod`` is being taken away (its node lost included)."""
    return pod.taken is not None and not (pod.self_reported and pod.node_lost is None)


def vet(
    pods: Sequence[ObservedPod],
    *,
    epoch: int,
    notice: PreemptNotice | None,
    reports: Iterable[ProgressEntry],
    missing: bool,
) -> Vetted:
    """Judge each claimed preemption among ``pods`` (the round's epoch's policy pods and
    rollout slots' pods); ``missing``: a pod of the gang went missing (the platform took
    it), ``notice``: the operator's notice in its own map."""
    if missing or any(attested(p) for p in pods):
        return Vetted(tuple(pods))  # a preemption of the gang: its knock-ons are its own

    def noticed(pod: ObservedPod) -> bool:
        if notice is None or notice.epoch != epoch:
            return False
        return notice.role is None or notice.role == pod.role  # as ``notice.stops``

    claims = {e.uid for e in reports if e.state == "preempted"}
    out: list[ObservedPod] = []
    events: list[Emit] = []
    for pod in pods:
        if noticed(pod):  # the operator stopped it: a knock-on of its own notice
            out.append(pod)
        elif pod.self_reported and pod.node_lost is None:
            out.append(_as_failure(pod))
            events.append(_ignored(pod, f"exited {EXIT_PREEMPTED} (preempted)", "a failure"))
        elif pod.uid in claims and pod.phase == "Running":
            out.append(pod)
            events.append(_ignored(pod, "reports its rank preempted", "nothing"))
        else:
            out.append(pod)
    return Vetted(tuple(out), tuple(events))


def _as_failure(pod: ObservedPod) -> ObservedPod:
    why = f"pod {pod.name} failed: exit code {EXIT_PREEMPTED}, a preemption no one attested"
    return replace(pod, disruption=None, self_reported=False, failure=why, exit_code=EXIT_PREEMPTED)


def _ignored(pod: ObservedPod, claim: str, counted: str) -> Emit:
    message = (
        f"pod {pod.name} ({pod.role} rank {pod.rank}) {claim}, but it has no DisruptionTarget "
        f"and no deletion, and the operator sent no notice: not a preemption, counted as "
        f"{counted}"
    )
    return Emit("Warning", IGNORED, message)
