"""The pure reconcile: from a RefitJob and its observed children to actions and next status.

Gang semantics: if any pod of the current epoch fails or is disrupted (DisruptionTarget,
eviction, deletion, a preempted exit), every pod stops, the epoch goes up, the rendezvous is
cleared, and after a backoff the gang is recreated under the same pod names, once the old
pods are gone.  Failures use up ``maxRestarts``; preemptions are counted apart and do not.

The rendezvous data arrives in ``Observed.rendezvous``: the barrier is opened and progress
read there (``coordinate.py``); between epochs the map is cleared before the new gang starts.

Must not import: kopf, kubernetes (the local runner drives this without an API).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Literal, TypeAlias

from refit_operator import conditions as cond
from refit_operator import coordinate as rdv
from refit_operator import names, render
from refit_operator.coordinate import PatchData
from refit_operator.models import (
    InvalidSpecError,
    Phase,
    RefitJobSpec,
    RefitJobStatus,
    RoleStatus,
    parse_spec,
)
from refit_operator.observe import Observed, ObservedPod
from refit_operator.phases import PhaseFacts, is_legal, next_phase
from refit_worker.contract.rendezvous import ProgressSummary
from refit_worker.contract.roles import ROLES

#: How soon to look again while old pods are still going away.
POLL_DELETING_S = 1.0


@dataclass(frozen=True)
class Create:
    obj: dict[str, Any]


@dataclass(frozen=True)
class Delete:
    api_version: str
    kind: str
    name: str


@dataclass(frozen=True)
class Emit:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


Action: TypeAlias = Create | Delete | PatchData | Emit


@dataclass(frozen=True)
class JobView:
    ref: render.JobRef
    generation: int
    raw_spec: Any
    status: RefitJobStatus


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    status: RefitJobStatus
    requeue_after: float | None = None


@dataclass
class _Round:
    """Mutable scratch of one reconcile round."""

    status: RefitJobStatus
    actions: list[Action] = field(default_factory=list)
    requeue: float | None = None

    def update(self, **changes: Any) -> None:
        self.status = self.status.model_copy(update=changes)

    def later(self, seconds: float) -> None:
        self.requeue = seconds if self.requeue is None else min(self.requeue, seconds)


def reconcile(
    job: JobView, observed: Observed, now: datetime, options: render.RenderOptions
) -> Decision:
    """Decide what to do about ``job`` given what exists; never touches the API.

    Every phase comes from the phase table (:func:`~refit_operator.phases.next_phase`), the
    invalid-spec path and the retry after a fix included.
    """
    old = job.status.phase
    try:
        spec = parse_spec(job.raw_spec)
        problems = names.name_problems(job.ref.name, spec.policy.replicas, spec.rollout.replicas)
        if problems:
            raise InvalidSpecError("; ".join(problems))
    except InvalidSpecError as exc:
        new = _next_phase(PhaseFacts(current=old, invalid=True))
        return _invalid(job, observed, str(exc), now, new)
    rnd = _Round(job.status)
    # A spec found invalid, then changed: start over as a new job would, in a new epoch.
    retry = _is_invalid(job.status) and job.status.observed_generation != job.generation
    if retry:
        rnd.update(message="", created_epoch=None, epoch=rnd.status.epoch + 1)
    facts = _act(
        job=job, spec=spec, observed=observed, now=now, options=options, rnd=rnd, retry=retry
    )
    new = _next_phase(replace(facts, current=old, retry_invalid=retry))
    _finish(rnd=rnd, job=job, spec=spec, observed=observed, old=old, new=new, now=now)
    return Decision(tuple(rnd.actions), rnd.status, rnd.requeue)


def _next_phase(facts: PhaseFacts) -> Phase:
    new = next_phase(facts)
    if not is_legal(facts.current, new):  # a bug in the rules, not in the input
        raise RuntimeError(f"illegal phase move {facts.current} -> {new}")
    return new


def _is_invalid(status: RefitJobStatus) -> bool:
    failed = cond.get_condition(status.conditions, cond.FAILED)
    return status.phase is Phase.FAILED and failed is not None and failed.reason == "InvalidSpec"


def _invalid(job: JobView, observed: Observed, message: str, now: datetime, new: Phase) -> Decision:
    st = job.status
    if new is not Phase.FAILED:
        # Only a Succeeded job stays put (the table keeps it final): its pods are gone and
        # nothing is created again, so an invalid edit has nothing to act on.
        return Decision((), st.model_copy(update={"observed_generation": job.generation}))
    actions: list[Action] = [Delete("v1", "Pod", p.name) for p in observed.pods if not p.deleting]
    if st.phase is not Phase.FAILED or st.message != message:
        actions.append(Emit("Warning", "InvalidSpec", message))
    status = st.model_copy(
        update={
            "phase": new,
            "message": message,
            "observed_generation": job.generation,
            "conditions": cond.set_condition(
                st.conditions, cond.FAILED, "True", reason="InvalidSpec", message=message, now=now
            ),
        }
    )
    return Decision(tuple(actions), status)


def _replicas(spec: RefitJobSpec, role: str) -> int:
    return spec.policy.replicas if role == "policy" else spec.rollout.replicas


def _expected(job: JobView, spec: RefitJobSpec) -> set[str]:
    return {
        names.pod_name(job.ref.name, role, rank)
        for role in ROLES
        for rank in range(_replicas(spec, role))
    }


def _delete_pods(rnd: _Round, pods: list[ObservedPod]) -> None:
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
    rnd: _Round,
    retry: bool = False,
) -> PhaseFacts:
    st = rnd.status
    pods = list(observed.pods)
    if st.phase is Phase.SUCCEEDED or (st.phase is Phase.FAILED and not retry):
        _delete_pods(rnd, [p for p in pods if p.phase not in ("Succeeded", "Failed")])
        return PhaseFacts(current=st.phase)
    for obj in render.render_static(job.ref, spec):
        if (obj["kind"], obj["metadata"]["name"]) not in observed.others:
            rnd.actions.append(Create(obj))
    if spec.suspend:
        if st.phase is not Phase.SUSPENDED:
            # A new epoch on resume keeps the suspended gang's rendezvous entries stale.
            rnd.update(epoch=st.epoch + 1, created_epoch=None, restart_at=None)
        _delete_pods(rnd, pods)
        return PhaseFacts(current=st.phase, suspended=True)
    current = [p for p in pods if p.epoch == st.epoch]
    stale = [p for p in pods if p.epoch != st.epoch]
    adopted = _adopt_unrecorded_gang(rnd, current, now)
    st = rnd.status
    created = st.created_epoch == st.epoch
    coord = _read_rendezvous(job, spec, observed, current, st.epoch) if created else None
    if coord is not None:
        _record(rnd, coord, now, spec.policy.replicas + spec.rollout.replicas)
    progress = coord.progress if coord is not None else None
    want = render.spec_hash(spec)
    if any(p.spec_hash != want for p in current):
        # Pods of another spec (world size, image...) need a new gang; neither a failure nor
        # a preemption.  Read from the pods, so a lost status write cannot hide it.
        return _restart_gang(
            job=job, spec=spec, pods=pods, failures=[], disruptions=[], now=now, rnd=rnd
        )
    finished, short = _finished(job, spec, current, progress) if created else (False, None)
    if finished and short is None:
        rnd.update(completion_time=now)
        _delete_pods(rnd, [p for p in pods if p.phase not in ("Succeeded", "Failed")])
        return PhaseFacts(current=st.phase, all_rollouts_done=True)
    # A rank that reported done has finished its part: its pod may go (a drained node).
    done = {names.pod_name(job.ref.name, r, k) for r, k in (progress.done if progress else ())}
    missing = sorted(_expected(job, spec) - {p.name for p in current} - done) if created else []
    if adopted and missing and not (coord is not None and coord.barrier_open):
        missing = _create_the_rest(job, spec, options, rnd, missing)
    failures = [p.failure for p in current if p.failure] + ([short] if short else [])
    # A drain of a pod whose rank already reported done takes nothing away either.
    disruptions = [
        f"{p.name}: {p.disruption}" for p in current if p.disruption and p.name not in done
    ]
    disruptions += [f"{name}: PodMissing" for name in missing]
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
        _fold_previous_epoch(rnd, spec, observed)
        if stale:
            rnd.later(POLL_DELETING_S)
            return PhaseFacts(current=st.phase, waiting_for_gang=st.epoch > 0)
        stale_data = rdv.clear(observed.rendezvous)
        if stale_data:  # old pods are gone: drop their entries before new ones arrive
            rnd.actions.extend(stale_data)
            rnd.later(POLL_DELETING_S)
            return PhaseFacts(current=st.phase, waiting_for_gang=st.epoch > 0)
        if st.restart_at is not None and now < st.restart_at:
            rnd.later((st.restart_at - now).total_seconds())
            return PhaseFacts(current=st.phase, waiting_for_gang=True)
        gang = render.render_gang(job.ref, spec, st.epoch, options, rnd.status.refits_completed)
        rnd.actions.extend(Create(p) for p in gang)
        rnd.update(created_epoch=st.epoch, restart_at=None, start_time=st.start_time or now)
        return PhaseFacts(current=st.phase)
    assert coord is not None  # created: the rendezvous was read above
    rnd.actions.extend(coord.patches)
    all_ready = all(p.ready or p.phase == "Succeeded" for p in current)
    return PhaseFacts(current=st.phase, all_ready=all_ready)


def _adopt_unrecorded_gang(rnd: _Round, current: list[ObservedPod], now: datetime) -> bool:
    """Pods of this epoch exist, yet the status does not say so: the write that recorded
    their creation was lost (a 409).  They are the gang: the rendezvous was cleared
    before they were created, and clearing it again would drop what they published."""
    st = rnd.status
    if not current or st.created_epoch == st.epoch:
        return False
    rnd.update(created_epoch=st.epoch, start_time=st.start_time or now)
    return True


def _create_the_rest(
    job: JobView,
    spec: RefitJobSpec,
    options: render.RenderOptions,
    rnd: _Round,
    missing: list[str],
) -> list[str]:
    """The lost round's creates ran in parallel and only some landed.  Before the barrier
    opens no rank has moved a byte, so the rest are created into the same epoch rather
    than counted as lost.  Returns what is still missing: nothing."""
    st = rnd.status
    gang = render.render_gang(job.ref, spec, st.epoch, options, st.refits_completed)
    rnd.actions.extend(Create(p) for p in gang if p["metadata"]["name"] in missing)
    return []


def _finished(
    job: JobView, spec: RefitJobSpec, current: list[ObservedPod], progress: ProgressSummary | None
) -> tuple[bool, str | None]:
    """Whether the gang's work is over, and why it fell short if it did.

    Over when every rank's pod exited 0, or went away after its rank reported done.  The
    job succeeded only if, on top of that, every rollout rank reported every refit
    committed: exit codes alone say nothing about refits (``/bin/true`` exits 0).
    """
    by_name = {p.name: p for p in current}
    done = progress.done if progress is not None else frozenset()
    for role in ROLES:
        for rank in range(_replicas(spec, role)):
            pod = by_name.get(names.pod_name(job.ref.name, role, rank))
            if pod is not None and pod.phase == "Succeeded":
                continue
            if (pod is None or pod.deleting) and (role, rank) in done:
                continue
            return False, None
    want = spec.transfer.refits
    got = progress.refits_completed if progress is not None else 0
    if progress is not None and progress.rollout_done and got >= want:
        return True, None
    return True, (
        f"every pod exited 0, but the rollout ranks reported {got} of {want} refits "
        "committed (workers report each refit to the rendezvous; RefitSession does)"
    )


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


def _record(rnd: _Round, coord: rdv.Coordination, now: datetime, total: int) -> None:
    """Conditions and figures from the ranks' own reports (never from exit codes)."""
    st = rnd.status
    ok: cond.Truth = "False" if coord.problem else "True"
    reason = "InvalidEntry" if coord.problem else "Readable"
    conds = cond.set_condition(
        st.conditions, cond.RENDEZVOUS, ok, reason=reason, message=coord.problem or "", now=now
    )
    connected: cond.Truth = "True" if coord.barrier_open else "False"
    conds = cond.set_condition(
        conds,
        cond.CONNECTED,
        connected,
        reason="BarrierOpen" if coord.barrier_open else "WaitingForRanks",
        message="" if coord.barrier_open else f"{coord.published} of {total} ranks published",
        now=now,
    )
    rnd.update(conditions=conds)
    p = coord.progress
    if p is not None:
        rnd.update(
            refits_completed=max(st.refits_completed, p.refits_completed),
            bytes_transferred=st.bytes_before_epoch + p.bytes_total,
            verification=p.verification if p.refits_completed else st.verification,
            last_throughput_bytes_per_second=(
                p.last_refit_gbps * 1e9
                if p.last_refit_gbps > 0
                else st.last_throughput_bytes_per_second
            ),
        )


def _fold_previous_epoch(rnd: _Round, spec: RefitJobSpec, observed: Observed) -> None:
    """Add what the stopped gang reported after the restart decision (its last refit's
    report can land after it), until its rendezvous entries are cleared."""
    st = rnd.status
    if st.epoch == 0:
        return
    world = (spec.policy.replicas, spec.rollout.replicas)
    old = rdv.progress_of(observed.rendezvous, epoch=st.epoch - 1, world=world)
    if old is None or old.bytes_total <= st.previous_epoch_bytes:
        return
    extra = old.bytes_total - st.previous_epoch_bytes
    rnd.update(
        bytes_before_epoch=st.bytes_before_epoch + extra,
        bytes_transferred=st.bytes_transferred + extra,
        previous_epoch_bytes=old.bytes_total,
        refits_completed=max(st.refits_completed, old.refits_completed),
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
    rnd: _Round,
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
        restart_at=now + timedelta(seconds=delay),
        message=message,
    )
    rnd.actions.append(Emit("Warning", reason, message))
    rnd.later(max(delay, POLL_DELETING_S))
    return PhaseFacts(current=st.phase, gang_disrupted=True)


def _role_status(
    spec: RefitJobSpec, pods: tuple[ObservedPod, ...], epoch: int, role: str
) -> RoleStatus:
    ready = sum(1 for p in pods if p.epoch == epoch and p.role == role and p.ready)
    return RoleStatus(ready=ready, total=_replicas(spec, role))


def _finish(
    *,
    rnd: _Round,
    job: JobView,
    spec: RefitJobSpec,
    observed: Observed,
    old: Phase,
    new: Phase,
    now: datetime,
) -> None:
    st = rnd.status
    ready: cond.Truth = "True" if new is Phase.RUNNING else "False"
    suspended: cond.Truth = "True" if new is Phase.SUSPENDED else "False"
    conds = cond.set_condition(
        st.conditions, cond.READY, ready, reason=new.value, message="", now=now
    )
    conds = cond.set_condition(
        conds, cond.SUSPENDED, suspended, reason=new.value, message="", now=now
    )
    if new is Phase.SUCCEEDED:
        conds = cond.set_condition(
            conds, cond.COMPLETE, "True", reason="RefitsDone", message="", now=now
        )
    if new is Phase.FAILED and old is not Phase.FAILED:
        conds = cond.set_condition(
            conds, cond.FAILED, "True", reason="RestartsExhausted", message=st.message, now=now
        )
    elif new is not Phase.FAILED and cond.get_condition(conds, cond.FAILED) is not None:
        conds = cond.set_condition(
            conds, cond.FAILED, "False", reason=new.value, message="", now=now
        )
    message = st.message if new in (Phase.RESTARTING, Phase.FAILED) else ""
    rnd.update(
        phase=new,
        message=message,
        conditions=conds,
        observed_generation=job.generation,
        policy=_role_status(spec, observed.pods, st.epoch, "policy"),
        rollout=_role_status(spec, observed.pods, st.epoch, "rollout"),
    )
    if new is not old:
        kind: Literal["Normal", "Warning"] = "Warning" if new is Phase.FAILED else "Normal"
        text = f"phase {old.value} -> {new.value}" + (f": {message}" if message else "")
        rnd.actions.append(Emit(kind, new.value, text))
