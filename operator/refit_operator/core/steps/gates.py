"""Letting the created gang run: the rendezvous barrier opens once every rank of the epoch
published (``coordinate.py``), and with ``SchedulingGates`` admission the gang's gate
comes off every pod together once all of them exist.
"""

from __future__ import annotations

from refit_operator.core.coordinate import decide_barrier
from refit_operator.core.decision import LiftGate
from refit_operator.core.draft import Draft
from refit_operator.core.observe import ObservedPod
from refit_operator.core.phases import Outcome
from refit_operator.core.round_input import RoundInput
from refit_operator.render import gang


def open_barrier(inp: RoundInput, draft: Draft) -> None:
    """Write the epoch's membership as the rendezvous read this round decides it."""
    if inp.rendezvous is not None:
        draft.actions.extend(decide_barrier(inp.rendezvous).patches)


def lift_gates(inp: RoundInput, draft: Draft) -> None:
    unmade = any(s.pod is None for s in inp.slots)
    if inp.spec.gang.admission != "SchedulingGates" or inp.absent or unmade:
        return  # no gates, or a pod of the epoch or a rollout slot's is still to come
    for pod in inp.current:
        if gang.GATE in pod.gates and not pod.deleting:
            keep = tuple(g for g in pod.gates if g != gang.GATE)
            draft.actions.append(LiftGate(pod.name, keep, pod.resource_version))


def mark_ready(inp: RoundInput, draft: Draft) -> Outcome:
    """The last step: the gang runs; Running once every policy pod and at least one rollout
    replica is Ready (or done): a replica being replaced shows as ``RolloutDegraded``."""
    policy = all(_up(p) for p in inp.policy)
    if policy and any(s.pod is not None and _up(s.pod) for s in inp.slots):
        draft.update(ready_epoch=draft.status.epoch)
        return Outcome.ALL_READY
    return Outcome.NOT_READY


def _up(pod: ObservedPod) -> bool:
    return pod.ready or pod.phase == "Succeeded"
