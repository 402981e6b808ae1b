"""``refit run`` doing its failure-domain flags: the SIGKILL of a rank-0 pod's process
group, the scale that ``kubectl scale`` would make, and the timing of what followed a
kill (the replacement's first committed refit).  What is due is decided in ``faults.py``.
"""

from __future__ import annotations

import copy
import os
import signal
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from refit_operator.api import names
from refit_operator.core.coordinate import merged
from refit_operator.core.decision import Emit, JobView
from refit_operator.local import faults as fault_plan
from refit_operator.local.faults import Fault, Fired

if TYPE_CHECKING:
    from refit_operator.local.runner import LocalCluster, RunOptions, RunResult


def pending(options: RunOptions, result: RunResult) -> bool:
    timing = any(f.recovered_s is None and f.uid for f in result.fired)
    return timing or len(result.fired) < len(options.faults)


def round_(
    options: RunOptions, result: RunResult, cluster: LocalCluster, view: JobView, now: float
) -> JobView:
    """``--kill-*-at-refit`` / ``--scale-rollout-at-refit``: do what is due (once each),
    time what followed the kills; returns the job as a scale left it."""
    pods = cluster.kubelet.pods()
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        seen = result.first_seen.setdefault(str(labels.get(names.LABEL_ROLE, "")), {})
        seen.setdefault(str(pod["metadata"]["uid"]), now)
    if not options.faults:
        return view
    progress = fault_plan.latest_progress(merged(cluster.observed_rendezvous()))
    for fired in result.fired:
        if fired.recovered_s is None and fired.uid and _recovered(fired, progress):
            fired.recovered_s = now - fired.at
            if fired.fault.kind == "kill-rollout":
                fired.seeded_from = fault_plan.replacement_seed(progress, "rollout", 0, fired.uid)
    done = frozenset(f.fault for f in result.fired)
    for fault in fault_plan.due(options.faults, done, result.ledger.most_committed()):
        done_now: Fired | None
        if fault.kind == "scale-rollout":
            view = _scaled(view, fault.replicas)
            done_now = Fired(
                fault, cluster.job.name, "", now, _uids(_live(pods, fault.untouched_role))
            )
        else:
            done_now = _kill(cluster, pods, fault, now, result.ledger.most_committed())
        if done_now is None:
            continue  # no live pod of that rank this round (being replaced): next round
        result.fired.append(done_now)
        cluster.on_event(Emit("Warning", "Fault", fault_plan.line(fault, done_now.target)))
    return view


def _recovered(fired: Fired, progress: Mapping[tuple[str, int], Any]) -> bool:
    """A rollout kill: the rank's replacement committed a refit.  A policy kill: a rollout
    rank committed a refit beyond those committed at the kill."""
    if fired.fault.kind == "kill-rollout":
        return fault_plan.replacement_committed(progress, "rollout", 0, fired.uid)
    rollout = [e for (role, _), e in progress.items() if role == "rollout"]
    return any(e.refits_completed > fired.committed for e in rollout)


def _live(pods: list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    """The running, not deleted pods of ``role``."""
    return [
        p
        for p in pods
        if "deletionTimestamp" not in p["metadata"]
        and p["status"]["phase"] == "Running"
        and (p["metadata"].get("labels") or {}).get(names.LABEL_ROLE) == role
    ]


def _uids(pods: list[dict[str, Any]]) -> frozenset[str]:
    return frozenset(str(p["metadata"]["uid"]) for p in pods)


def _kill(
    cluster: LocalCluster, pods: list[dict[str, Any]], fault: Fault, now: float, committed: int
) -> Fired | None:
    """SIGKILL the process group of the live rank-0 pod of the fault's role."""
    role = "rollout" if fault.kind == "kill-rollout" else "policy"
    target = next(
        (p for p in _live(pods, role) if p["metadata"]["labels"].get(names.LABEL_RANK) == "0"),
        None,
    )
    pid = cluster.kubelet.pids().get(target["metadata"]["name"]) if target else None
    if target is None or pid is None:
        return None
    os.killpg(pid, signal.SIGKILL)  # the pod's own session (pid == pgid): the whole group
    meta = target["metadata"]
    others = _uids(_live(pods, fault.untouched_role))
    return Fired(fault, str(meta["name"]), str(meta["uid"]), now, others, committed=committed)


def _scaled(view: JobView, replicas: int) -> JobView:
    """The job after ``kubectl scale --replicas``: the spec's rollout replicas, and the
    next ``metadata.generation`` (a scale is a spec change to the API server)."""
    raw = copy.deepcopy(dict(view.raw_spec))
    raw.setdefault("rollout", {})["replicas"] = replicas
    return JobView(view.ref, view.generation + 1, raw, view.status)
