"""The pure reconcile: from a RefitJob and its observed children to actions and next status.

Gang semantics: if any pod of the current epoch fails or is disrupted (DisruptionTarget,
eviction, deletion, a preempted exit), every pod stops, the epoch goes up, the rendezvous is
cleared, and after a backoff the gang is recreated under the same pod names, once the old
pods are gone.  Failures use up ``maxRestarts``; preemptions are counted apart and do not.
An epoch whose pods are not all Ready within ``startDeadlineSeconds`` fails the same way.

Gang admission (``gang.py``): with scheduling gates, the gate comes off every pod of the
epoch at once, once all of them exist.  A suspended job creates nothing; a job another
controller manages (``spec.managedBy``) is left alone.

The rendezvous data arrives in ``Observed.rendezvous``: the barrier is opened and progress
read there (``coordinate.py``); between epochs the map is cleared before the new gang starts.
What the ranks reported becomes the status in ``progress.py``.

Must not import: kopf, kubernetes (the local runner drives this without an API).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Literal

from refit_operator import conditions as cond
from refit_operator import coordinate as rdv
from refit_operator import gang, lifecycle, names, progress, render
from refit_operator.coordinate import PatchData
from refit_operator.decision import (
    Action,
    Create,
    Decision,
    Delete,
    DeleteJob,
    Emit,
    JobView,
    LiftGate,
    Round,
)
from refit_operator.models import (
    InvalidSpecError,
    Phase,
    RefitJobSpec,
    RefitJobStatus,
    managed_elsewhere,
    parse_spec,
)
from refit_operator.observe import Observed, ObservedPod
from refit_operator.phases import PhaseFacts, checked_next_phase
from refit_operator.refusals import after_writes, expire, refuse
from refit_worker.contract.roles import ROLES

#: How soon to look again while old pods are still going away.
POLL_DELETING_S = 1.0
#: Reasons of the Failed condition that a new generation of the spec may fix.
SPEC_REASONS = frozenset({"InvalidSpec", "TemplateConflict", "ChildRejected"})

__all__ = [
    "Action",
    "Create",
    "Decision",
    "Delete",
    "DeleteJob",
    "Emit",
    "JobView",
    "LiftGate",
    "PatchData",
    "after_writes",
    "parse_spec",
    "reconcile",
    "refuse",
]


def reconcile(
    job: JobView, observed: Observed, now: datetime, options: render.RenderOptions
) -> Decision:
    """Decide what to do about ``job`` given what exists; never touches the API.

    Every phase comes from the phase table (:func:`~refit_operator.phases.next_phase`), the
    invalid-spec path and the retry after a fix included.
    """
    if managed_elsewhere(job.raw_spec):
        return Decision((), job.status, hands_off=True)
    old = job.status.phase
    reason = "InvalidSpec"
    try:
        spec = parse_spec(job.raw_spec)
        problems = names.name_problems(job.ref.name, spec.policy.replicas, spec.rollout.replicas)
        if not problems:
            reason = "TemplateConflict"
            problems = render.template_conflicts(job.ref, spec, options)
        if problems:
            raise InvalidSpecError("; ".join(problems))
    except InvalidSpecError as exc:
        new = checked_next_phase(PhaseFacts(current=old, invalid=True))
        return refuse(job, observed, str(exc), now=now, new=new, reason=reason)
    rnd = Round(job.status, job.generation, now)
    # A spec found invalid, then changed: start over as a new job would, in a new epoch.
    retry = _is_invalid(job.status) and job.status.observed_generation != job.generation
    if retry:
        rnd.update(
            message="",
            created_epoch=None,
            epoch=rnd.status.epoch + 1,
            epoch_start_time=None,
            completion_time=None,
        )
    facts = _act(
        job=job, spec=spec, observed=observed, now=now, options=options, rnd=rnd, retry=retry
    )
    new = checked_next_phase(replace(facts, current=old, retry_invalid=retry))
    _finish(rnd=rnd, job=job, spec=spec, observed=observed, old=old, new=new)
    expire(rnd, job.raw_spec, new)
    return Decision(tuple(rnd.actions), rnd.status, rnd.requeue)


def _is_invalid(status: RefitJobStatus) -> bool:
    failed = cond.get_condition(status.conditions, cond.FAILED)
    return status.phase is Phase.FAILED and failed is not None and failed.reason in SPEC_REASONS


def _replicas(spec: RefitJobSpec, role: str) -> int:
    return spec.policy.replicas if role == "policy" else spec.rollout.replicas


def _expected(job: JobView, spec: RefitJobSpec) -> set[str]:
    return {
        names.pod_name(job.ref.name, role, rank)
        for role in ROLES
        for rank in range(_replicas(spec, role))
    }


def _delete_pods(rnd: Round, pods: list[ObservedPod]) -> None:
    rnd.actions.extend(Delete("v1", "Pod", p.name) for p in pods if not p.deleting)


def _backoff(spec: RefitJobSpec, restarts: int) -> float:
    fp = spec.failure_policy
    return float(min(fp.max_backoff_seconds, fp.backoff_seconds * 2 ** max(0, restarts - 1)))


def _act(
    *,
    job: JobView,
    spec: RefitJobSpec,
    observed: Observed,
    now: datetime,
    options: render.RenderOptions,
    rnd: Round,
    retry: bool = False,
) -> PhaseFacts:
    st = rnd.status
    pods = list(observed.pods)
    if st.phase is Phase.SUCCEEDED or (st.phase is Phase.FAILED and not retry):
        _delete_pods(rnd, [p for p in pods if p.phase not in ("Succeeded", "Failed")])
        return PhaseFacts(current=st.phase)
    if spec.suspend:
        return _suspend(rnd, job, spec, pods)
    if lifecycle.past(st.start_time, spec.active_deadline_seconds, now) is not None:
        return _out_of_time(rnd, spec, pods)
    for obj in render.render_static(job.ref, spec):
        if (obj["kind"], obj["metadata"]["name"]) not in observed.others:
            rnd.actions.append(Create(obj))
    left = lifecycle.until(st.start_time, spec.active_deadline_seconds, now)
    if left is not None:
        rnd.later(left)
    current = [p for p in pods if p.epoch == st.epoch]
    stale = [p for p in pods if p.epoch != st.epoch]
    adopted = _adopt_unrecorded_gang(rnd, current, now)
    st = rnd.status
    created = st.created_epoch == st.epoch
    coord = _read_rendezvous(job, spec, observed, current, st.epoch) if created else None
    if coord is not None:
        total = spec.policy.replicas + spec.rollout.replicas
        rnd.status = progress.record(rnd.status, coord, total, now=now, generation=job.generation)
    summary = coord.progress if coord is not None else None
    want = render.spec_hash(spec)
    if any(p.spec_hash != want for p in current):
        # Pods of another spec (world size, image...) need a new gang; neither a failure nor
        # a preemption.  Read from the pods, so a lost status write cannot hide it.
        return _restart_gang(
            job=job, spec=spec, pods=pods, failures=[], disruptions=[], now=now, rnd=rnd
        )
    finished, short = (
        progress.finished(job.ref.name, spec, current, summary)
        if created
        else (
            False,
            None,
        )
    )
    if finished and short is None:
        rnd.update(completion_time=now)
        _delete_pods(rnd, [p for p in pods if p.phase not in ("Succeeded", "Failed")])
        return PhaseFacts(current=st.phase, all_rollouts_done=True)
    # A rank that reported done has finished its part: its pod may go (a drained node).
    done = {names.pod_name(job.ref.name, r, k) for r, k in (summary.done if summary else ())}
    absent = sorted(_expected(job, spec) - {p.name for p in current} - done)
    missing = absent if created else []
    if adopted and missing and not (coord is not None and coord.barrier_open):
        missing = _create_the_rest(job, spec, options, rnd, missing)
    failures = [p.failure for p in current if p.failure] + ([short] if short else [])
    # A drain of a pod whose rank already reported done takes nothing away either.
    disruptions = [
        f"{p.name}: {p.disruption}" for p in current if p.disruption and p.name not in done
    ]
    disruptions += [f"{name}: PodMissing" for name in missing]
    late = _late(rnd, spec, current, absent)
    if late is not None and not failures:
        failures.append(late)
        rnd.failed_reason = "StartDeadlineExceeded"
    if failures or disruptions:
        return _restart_gang(
            job=job,
            spec=spec,
            pods=pods,
            notice_from=next((p for p in current if p.disruption), None),
            failures=failures,
            disruptions=disruptions,
            now=now,
            rnd=rnd,
        )
    _delete_pods(rnd, stale)
    if not created:
        return _create_gang(
            job=job,
            spec=spec,
            observed=observed,
            stale=stale,
            options=options,
            rnd=rnd,
        )
    assert coord is not None  # created: the rendezvous was read above
    rnd.actions.extend(coord.patches)
    if not absent:  # every pod of the epoch exists (none is still being created)
        _lift_gates(rnd, spec, current)
    all_ready = all(p.ready or p.phase == "Succeeded" for p in current)
    if all_ready:
        rnd.update(ready_epoch=st.epoch)
    return PhaseFacts(current=st.phase, all_ready=all_ready)


def _out_of_time(rnd: Round, spec: RefitJobSpec, pods: list[ObservedPod]) -> PhaseFacts:
    """The job ran past ``activeDeadlineSeconds``: its pods stop and it fails, as a Job's."""
    _delete_pods(rnd, pods)
    rnd.failed_reason = "DeadlineExceeded"
    limit = spec.active_deadline_seconds
    rnd.update(
        message=f"the job ran past activeDeadlineSeconds ({limit} s)", completion_time=rnd.now
    )
    return PhaseFacts(current=rnd.status.phase, deadline_exceeded=True)


def _suspend(rnd: Round, job: JobView, spec: RefitJobSpec, pods: list[ObservedPod]) -> PhaseFacts:
    """Stop the gang; create nothing (what exists from before stays)."""
    st = rnd.status
    if st.phase is not Phase.SUSPENDED:
        # A new epoch on resume keeps the suspended gang's rendezvous entries stale; the
        # active deadline starts again on resume, as a Job's does.
        _drop_pod_group(rnd, job, spec, st.epoch)
        rnd.update(
            epoch=st.epoch + 1,
            created_epoch=None,
            restart_at=None,
            epoch_start_time=None,
            start_time=None,
        )
    _delete_pods(rnd, pods)
    return PhaseFacts(current=st.phase, suspended=True)


def _adopt_unrecorded_gang(rnd: Round, current: list[ObservedPod], now: datetime) -> bool:
    """Pods of this epoch exist, yet the status does not say so: the write that recorded
    their creation was lost (a 409), or some of the creates were refused.  They are the
    gang: the rendezvous was cleared
    before they were created, and clearing it again would drop what they published."""
    st = rnd.status
    if not current or st.created_epoch == st.epoch:
        return False
    rnd.update(
        created_epoch=st.epoch,
        start_time=st.start_time or now,
        epoch_start_time=st.epoch_start_time or now,
    )
    return True


def _create_the_rest(
    job: JobView,
    spec: RefitJobSpec,
    options: render.RenderOptions,
    rnd: Round,
    missing: list[str],
) -> list[str]:
    """The lost round's creates ran in parallel and only some landed.  Before the barrier
    opens no rank has moved a byte, so the rest are created into the same epoch rather
    than counted as lost.  Returns what is still missing: nothing."""
    st = rnd.status
    gang = render.render_gang(job.ref, spec, st.epoch, options, st.refits_completed)
    rnd.actions.extend(Create(p) for p in gang if p["metadata"]["name"] in missing)
    return []


def _late(
    rnd: Round, spec: RefitJobSpec, current: list[ObservedPod], absent: list[str]
) -> str | None:
    """The start-deadline failure of the epoch, if its time is up; else None (and the
    Pending message says what the pods wait for)."""
    st = rnd.status
    if st.ready_epoch == st.epoch or st.epoch_start_time is None:
        return None
    late = lifecycle.late_pods(current, absent)
    rnd.waiting = lifecycle.waiting_summary(late)
    deadline = spec.start_deadline_seconds
    if not late:
        return None
    if lifecycle.past(st.epoch_start_time, deadline, rnd.now) is None:
        left = lifecycle.until(st.epoch_start_time, deadline, rnd.now)
        if left is not None:
            rnd.later(left)
        return None
    return lifecycle.start_failure(st.epoch, deadline, late)


def _create_gang(
    *,
    job: JobView,
    spec: RefitJobSpec,
    observed: Observed,
    stale: list[ObservedPod],
    options: render.RenderOptions,
    rnd: Round,
) -> PhaseFacts:
    """Create the epoch's gang once the old one and its rendezvous entries are gone."""
    st = rnd.status
    rnd.status = progress.fold_previous_epoch(rnd.status, spec, observed)
    if stale:
        rnd.later(POLL_DELETING_S)
        return PhaseFacts(current=st.phase, waiting_for_gang=st.epoch > 0)
    stale_data = rdv.clear(observed.rendezvous)
    if stale_data:  # old pods are gone: drop their entries before new ones arrive
        rnd.actions.extend(stale_data)
        rnd.later(POLL_DELETING_S)
        return PhaseFacts(current=st.phase, waiting_for_gang=st.epoch > 0)
    if st.restart_at is not None and rnd.now < st.restart_at:
        rnd.later((st.restart_at - rnd.now).total_seconds())
        return PhaseFacts(current=st.phase, waiting_for_gang=True)
    gang_objs = render.render_gang(job.ref, spec, st.epoch, options, rnd.status.refits_completed)
    rnd.actions.extend(Create(p) for p in gang_objs)
    rnd.update(
        created_epoch=st.epoch,
        restart_at=None,
        start_time=st.start_time or rnd.now,
        epoch_start_time=st.epoch_start_time or rnd.now,
    )
    rnd.later(float(spec.start_deadline_seconds))
    return PhaseFacts(current=st.phase)


def _lift_gates(rnd: Round, spec: RefitJobSpec, current: list[ObservedPod]) -> None:
    """Every pod of the epoch exists: take the gang's gate off all of them together."""
    if spec.gang.admission != "SchedulingGates":
        return
    for pod in current:
        if gang.GATE in pod.gates and not pod.deleting:
            keep = tuple(g for g in pod.gates if g != gang.GATE)
            rnd.actions.append(LiftGate(pod.name, keep, pod.resource_version))


def _drop_pod_group(rnd: Round, job: JobView, spec: RefitJobSpec, epoch: int) -> None:
    api = gang.pod_group_api(spec.gang)
    if api is not None:
        rnd.actions.append(Delete(api, "PodGroup", gang.pod_group_name(job.ref.name, epoch)))


def _read_rendezvous(
    job: JobView, spec: RefitJobSpec, observed: Observed, current: list[ObservedPod], epoch: int
) -> rdv.Coordination:
    uids = {(p.role, p.rank): p.uid for p in current if p.role in ROLES and p.uid}
    return rdv.coordinate(
        job.ref.name,
        observed.rendezvous,
        epoch=epoch,
        world=(spec.policy.replicas, spec.rollout.replicas),
        pod_uids=uids,
    )


def _restart_gang(
    *,
    job: JobView,
    spec: RefitJobSpec,
    pods: list[ObservedPod],
    notice_from: ObservedPod | None = None,
    failures: list[str],
    disruptions: list[str],
    now: datetime,
    rnd: Round,
) -> PhaseFacts:
    st = rnd.status
    if notice_from is not None and disruptions and not failures:
        # Ranks hear the notice and stop at a safe point, ahead of their own signals.
        notice = rdv.preempt_notice(
            job.ref.name,
            epoch=st.epoch,
            pod=notice_from.name,
            uid=notice_from.uid,
            reason=disruptions[0],
        )
        if notice is not None:
            rnd.actions.append(notice)
    _delete_pods(rnd, pods)
    _drop_pod_group(rnd, job, spec, st.epoch)
    if failures and st.restarts >= spec.failure_policy.max_restarts:
        message = f"{failures[0]}; maxRestarts ({spec.failure_policy.max_restarts}) used up"
        rnd.update(message=message, completion_time=now)
        return PhaseFacts(current=st.phase, restarts_exhausted=True)
    if failures:
        restarts = st.restarts + 1
        reason, message = "Restarted", f"gang restart {restarts}: {failures[0]}"
        rnd.update(restarts=restarts)
        delay = _backoff(spec, restarts)
    elif disruptions:
        reason = "Preempted"
        message = f"gang preempted ({st.preemptions + 1}): {disruptions[0]}"
        rnd.update(preemptions=st.preemptions + 1)
        delay = spec.failure_policy.backoff_seconds
    else:
        reason, message, delay = "SpecChanged", "the spec changed; recreating the gang", 0.0
    rnd.update(
        epoch=st.epoch + 1,
        bytes_before_epoch=rnd.status.bytes_transferred,
        previous_epoch_bytes=rnd.status.bytes_transferred - st.bytes_before_epoch,
        created_epoch=None,
        epoch_start_time=None,
        restart_at=now + timedelta(seconds=delay),
        message=message,
    )
    rnd.condition(cond.RESTARTING, "True", reason, message)
    rnd.actions.append(Emit("Warning", reason, message))
    rnd.later(max(delay, POLL_DELETING_S))
    return PhaseFacts(current=st.phase, gang_disrupted=True)


def _finish(
    *,
    rnd: Round,
    job: JobView,
    spec: RefitJobSpec,
    observed: Observed,
    old: Phase,
    new: Phase,
) -> None:
    st = rnd.status
    rnd.condition(cond.READY, "True" if new is Phase.RUNNING else "False", new.value)
    rnd.condition(cond.SUSPENDED, "True" if new is Phase.SUSPENDED else "False", new.value)
    if new is not Phase.RESTARTING:
        rnd.condition(cond.RESTARTING, "False", new.value)
    if new is Phase.SUCCEEDED:
        rnd.condition(cond.COMPLETE, "True", "RefitsDone")
    if new is Phase.FAILED and old is not Phase.FAILED:
        rnd.condition(cond.FAILED, "True", rnd.failed_reason, st.message)
    elif new is not Phase.FAILED and cond.get_condition(rnd.status.conditions, cond.FAILED):
        rnd.condition(cond.FAILED, "False", new.value)
    if new in (Phase.RESTARTING, Phase.FAILED):
        message = st.message
    elif new is Phase.PENDING:
        message = rnd.waiting
    else:
        message = ""
    rnd.update(
        phase=new,
        message=message,
        observed_generation=job.generation,
        policy=progress.role_status(spec, observed.pods, st.epoch, "policy"),
        rollout=progress.role_status(spec, observed.pods, st.epoch, "rollout"),
    )
    if new is not old:
        kind: Literal["Normal", "Warning"] = "Warning" if new is Phase.FAILED else "Normal"
        text = f"phase {old.value} -> {new.value}" + (f": {message}" if message else "")
        rnd.actions.append(Emit(kind, new.value, text))
