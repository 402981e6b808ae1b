"""Reading observed children: a pod manifest reduced to what the reconcile decides on, the
rendezvous map decoded once per round (:attr:`Observed.entries`), and the facts of the
nodes the pods are on (``nodes.py`` decides from them whether a pod is lost with its node).

A pod's failure says why in the kubelet's terms: a rank killed by a signal is "killed by
SIGKILL (exit code 137)" and an OOM kill "OOMKilled", never a log line (the container's
log tail is what a signal death leaves as its termination message, and it says nothing
about the kill); an exit of its own quotes its termination message.

Pure.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import cached_property
from typing import Any

from refit_operator.api import names
from refit_operator.core.coordinate import Decoded, decode
from refit_operator.core.nodes import DEFAULT_NODE_LOST_SECONDS, NodeFacts, holds_place, node_lost
from refit_worker.contract.exits import EXIT_PREEMPTED

#: status.reason values of pods the kubelet pushed out (node pressure, shutdown).
_EVICTED_REASONS = frozenset({"Evicted", "Preempting", "Terminated", "Shutdown", "NodeShutdown"})


@dataclass(frozen=True)
class ObservedPod:
    name: str
    uid: str
    role: str
    rank: int
    epoch: int
    phase: str
    #: The spec digest the pod was rendered from (``render.pods.spec_hash``).
    spec_hash: str
    ready: bool
    deleting: bool
    #: Why the pod is being taken away (None: it is not): a preemption, not a failure.
    disruption: str | None
    #: Why it failed on its own (None: it did not).
    failure: str | None
    #: Why it is not running yet (a container waiting state, Unschedulable with the
    #: scheduler's message, a scheduling gate), or None.
    waiting: str | None = None
    #: Its scheduling gates (the gang's is lifted once every pod of the epoch exists).
    gates: tuple[str, ...] = ()
    resource_version: str = ""
    #: The exit code of its terminated container when it failed on its own (else None).
    exit_code: int | None = None
    #: A rollout pod's generation (label ``refit.dev/generation``; 0 for policy pods).
    generation: int = 0
    #: The node it is bound to (``spec.nodeName``), or None while unscheduled.
    node: str | None = None
    #: Why the pod's node is lost (NotReady past ``nodeLostSeconds``, out-of-service), or
    #: None: such a pod is disrupted and gone, never waited for.
    node_lost: str | None = None
    #: Its ``disruption`` is only its worker's word (it exited ``EXIT_PREEMPTED``), not the
    #: platform's: believed only as the knock-on of an attested one (``claims.py``).
    self_reported: bool = False

    @property
    def taken(self) -> str | None:
        """Why the pod is being taken away (its node lost included), or None."""
        if self.node_lost is not None and self.phase != "Succeeded":
            return f"NodeLost: {self.node_lost}"
        return self.disruption

    @property
    def gone(self) -> bool:
        """Nothing more to wait for: it exited, or its node is lost."""
        return self.phase in ("Succeeded", "Failed") or self.node_lost is not None


@dataclass(frozen=True)
class Observed:
    """Everything the reconcile sees of a job's children."""

    pods: tuple[ObservedPod, ...] = ()
    #: ``(kind, name)`` of each existing non-pod child.
    others: frozenset[tuple[str, str]] = frozenset()
    #: Rendezvous ConfigMap name -> its data (``coordinate.py`` decides from it).
    rendezvous: Mapping[str, Mapping[str, str]] | None = None
    #: Node name -> its facts, for every node a pod is bound to (none: nodes not read).
    nodes: Mapping[str, NodeFacts] = field(default_factory=dict)
    #: ``spec.failurePolicy.nodeLostSeconds`` the pods' ``node_lost`` was decided with.
    node_lost_seconds: float = DEFAULT_NODE_LOST_SECONDS
    #: The time ``node_lost`` was decided at (None: nodes were not looked at).
    observed_at: datetime | None = None

    @cached_property
    def entries(self) -> Decoded:
        """The rendezvous map decoded, once for the whole round (the reconcile and the
        metrics both read it)."""
        return decode(self.rendezvous)


def _int_label(labels: Mapping[str, Any], key: str) -> int:
    try:
        return int(labels.get(key, "-1"))
    except (TypeError, ValueError):
        return -1


def _terminated(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    out = []
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            out.append(term)
    return out


#: How much of a container's termination message the job's status quotes.
MESSAGE_CHARS = 300


def _last_line(message: str) -> str:
    """The line that says why: a worker's own reason, or a traceback's exception line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1][:MESSAGE_CHARS] if lines else ""


#: Exit codes above this one are a signal's (128 + n), as a shell and the kubelet report.
_SIGNAL_BASE = 128


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _failure_detail(term: Mapping[str, Any] | None) -> tuple[str, bool]:
    """What a failed container's terminated state says, and whether its termination
    message is worth quoting (not after a kill: it is then only the log's tail)."""
    if term is None:
        return "no exit code", True
    code = term.get("exitCode")
    if term.get("reason") == "OOMKilled":
        return f"OOMKilled (exit code {code})", False
    number = term.get("signal")
    if not number and isinstance(code, int) and _SIGNAL_BASE < code <= _SIGNAL_BASE + 64:
        number = code - _SIGNAL_BASE
    if isinstance(number, int) and number > 0:
        return f"killed by {_signal_name(number)} (exit code {code})", False
    return f"exit code {code}", True


def _failure(name: str, status: Mapping[str, Any], terminated: list[Mapping[str, Any]]) -> str:
    failed = next((t for t in terminated if t.get("exitCode")), None)
    term = failed or (terminated[0] if terminated else None)
    detail, quote = _failure_detail(term)
    if status.get("reason"):
        detail, quote = str(status["reason"]), True
    why = _last_line(next((str(t["message"]) for t in terminated if t.get("message")), ""))
    return f"pod {name} failed: {detail}" + (f": {why}" if why and quote else "")


def _exit_code(terminated: list[Mapping[str, Any]]) -> int | None:
    codes = [t.get("exitCode") for t in terminated if isinstance(t.get("exitCode"), int)]
    return next((c for c in codes if c), codes[0] if codes else None)


def _waiting(status: Mapping[str, Any], gates: tuple[str, ...]) -> str | None:
    """Why a pod is not running yet, the most specific reason first."""
    statuses = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") and waiting["reason"] != "PodInitializing":
            message = _last_line(str(waiting.get("message") or ""))
            return f"{waiting['reason']}" + (f": {message}" if message else "")
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            reason = condition.get("reason") or "NotScheduled"
            message = _last_line(str(condition.get("message") or ""))
            return f"{reason}: {message}" if message else str(reason)
    if gates:
        return f"SchedulingGated: {', '.join(gates)}"
    return None


def observe_pod(pod: Mapping[str, Any]) -> ObservedPod:
    """Classify a pod manifest: ready, disrupted (preempted) or failed, and why."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = pod.get("status") or {}
    phase = str(status.get("phase") or "Pending")
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = phase == "Running" and (conditions.get("Ready") or {}).get("status") == "True"
    disruption: str | None = None
    self_reported = False
    target = conditions.get("DisruptionTarget") or {}
    terminated = _terminated(status)
    if phase == "Succeeded":
        pass  # its work is done: a drain or deletion now takes nothing away
    elif target.get("status") == "True":
        disruption = f"DisruptionTarget: {target.get('reason') or 'unknown'}"
    elif meta.get("deletionTimestamp"):
        disruption = "PodDeleted"
    elif phase == "Failed" and status.get("reason") in _EVICTED_REASONS:
        disruption = f"Evicted: {status.get('reason')}"
    elif any(t.get("exitCode") == EXIT_PREEMPTED for t in terminated):
        disruption, self_reported = f"WorkerPreempted: exit code {EXIT_PREEMPTED}", True
    failed = disruption is None and phase == "Failed"
    failure = _failure(str(meta.get("name")), status, terminated) if failed else None
    gates = tuple(
        str(g.get("name", "")) for g in (pod.get("spec") or {}).get("schedulingGates") or []
    )
    return ObservedPod(
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        role=str(labels.get(names.LABEL_ROLE, "")),
        rank=_int_label(labels, names.LABEL_RANK),
        epoch=_int_label(labels, names.LABEL_EPOCH),
        phase=phase,
        spec_hash=str((meta.get("annotations") or {}).get(names.ANNOTATION_SPEC_HASH, "")),
        ready=ready,
        deleting=bool(meta.get("deletionTimestamp")),
        disruption=disruption,
        failure=failure,
        waiting=None if phase != "Pending" else _waiting(status, gates),
        gates=gates,
        resource_version=str(meta.get("resourceVersion", "")),
        exit_code=_exit_code(terminated) if failed else None,
        generation=max(0, _int_label(labels, names.LABEL_GENERATION)),
        node=str((pod.get("spec") or {}).get("nodeName") or "") or None,
        self_reported=self_reported,
    )


def with_node(
    pod: ObservedPod, nodes: Mapping[str, NodeFacts], now: datetime, bound: float
) -> ObservedPod:
    """``pod`` with ``node_lost`` decided from its node's facts (a finished pod loses
    nothing with its node; a node not read says nothing)."""
    if pod.node is None or not holds_place(pod.phase):
        return pod
    return replace(pod, node_lost=node_lost(nodes.get(pod.node), now, bound))


def observe(
    pods: Sequence[Mapping[str, Any]],
    others: Sequence[Mapping[str, Any]],
    rendezvous: Mapping[str, Mapping[str, str]] | None = None,
    *,
    nodes: Mapping[str, NodeFacts] | None = None,
    now: datetime | None = None,
    node_lost_seconds: float = DEFAULT_NODE_LOST_SECONDS,
) -> Observed:
    """What a round sees; with ``nodes`` and ``now``, which pods are lost with their node."""
    seen = (observe_pod(p) for p in pods)
    if nodes and now is not None:
        seen = (with_node(p, nodes, now, node_lost_seconds) for p in seen)
    return Observed(
        pods=tuple(sorted(seen, key=lambda p: p.name)),
        others=frozenset(
            (str(o.get("kind", "")), str((o.get("metadata") or {}).get("name", ""))) for o in others
        ),
        rendezvous=rendezvous,
        nodes=dict(nodes or {}),
        node_lost_seconds=node_lost_seconds,
        observed_at=now if nodes else None,
    )
