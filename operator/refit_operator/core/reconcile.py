"""The pure reconcile: from a RefitJob and its observed children to actions and the next
status, as a list of named policy steps (``steps/``), each in a module named for what it
decides and each able to end the round's decision with a finding.

Failure domains (docs/failure-domains.md): a rollout replica that fails or is disrupted
(DisruptionTarget, eviction, deletion, a preempted exit, a lost node, gone missing) is
replaced alone under its next generation, the policy pods untouched; failures use up
``rollout.failurePolicy.maxReplacements``.  A policy pod that fails or is disrupted
stops the policy gang: the epoch goes up, the rendezvous is cleared of all but the
serving rollout replicas' entries, and after a backoff the policy gang is recreated once
its old pods are gone; failures use up ``maxRestarts``, preemptions are counted apart.
A spec change (other than ``rollout.replicas``), a late start and a suspend stop every
pod; a failure the worker marks as not retryable fails the job at once.

Must not import: kopf, kubernetes, aiohttp (the local runner drives this without an API).
"""

from __future__ import annotations

from datetime import datetime

from refit_operator.core import byte_accounting, lost_nodes, ttl
from refit_operator.core.decision import Decision, JobView
from refit_operator.core.draft import Draft
from refit_operator.core.observe import Observed
from refit_operator.core.phases import Finding, checked_next_phase, facts_of
from refit_operator.core.refusal import refuse
from refit_operator.core.round_input import RoundInput, read_round
from refit_operator.core.steps import (
    adoption,
    closing,
    deadlines,
    failure_policy,
    gang_creation,
    gates,
    reports,
    rollout_replicas,
    settled,
    spec_change,
    start_deadline,
    static_children,
    success_policy,
    suspend,
    validity,
)
from refit_operator.models import managed_elsewhere
from refit_operator.render import RenderOptions


def reconcile(job: JobView, observed: Observed, now: datetime, options: RenderOptions) -> Decision:
    """Decide what to do about ``job`` given what exists; never touches the API.

    Every phase comes from the phase table (:func:`~refit_operator.core.phases.next_phase`),
    the invalid-spec path and the retry after a fix included.
    """
    if managed_elsewhere(job.basics):  # another controller's job: not even its status
        return Decision((), job.status, hands_off=True)
    spec = validity.check_spec(job, options)
    if isinstance(spec, validity.Invalid):
        return refuse(job, observed, spec.message, now=now, reason=spec.reason)
    retry = validity.retrying(job)
    draft = Draft(validity.start_status(job, retry=retry), job.generation, now)
    inp = read_round(job, spec, observed, now=now, options=options, start=draft.status, retry=retry)
    finding = decide(inp, draft)
    # Whatever the steps decided: pods on lost nodes are announced, force-deleted when out
    # of service, and a not-ready node's bound is waited out.
    lost_nodes.act(observed, draft)
    new = checked_next_phase(facts_of(finding, current=job.status.phase, retry_invalid=retry))
    closing.close_round(inp, draft, old=job.status.phase, new=new)
    ttl.expire(draft, job.basics.ttl_seconds_after_finished, new)
    return draft.decision()


def decide(inp: RoundInput, draft: Draft) -> Finding:
    """The policy steps in order; the first that finds something ends the decision."""
    # The bytes every rollout pod reported receiving, counted once per pod, whatever the
    # steps decide.
    draft.status = byte_accounting.account(draft.status, inp.observed.entries.progress())
    return (
        # A finished job stays finished: stop what still runs of it.
        settled.keep_finished(inp, draft)
        # spec.suspend: stop the gang, create nothing.
        or suspend.suspend(inp, draft)
        # activeDeadlineSeconds ran out: fail.
        or deadlines.active_deadline(inp, draft)
        # Services, the rendezvous ConfigMap, the workers' RBAC: create what is missing.
        or static_children.create_missing(inp, draft)
        # Pods of the epoch that a lost status write did not record are the gang.
        or adoption.adopt_unrecorded_gang(inp, draft)
        # The rollout slots (one per rank asked for, at its generation) as status.
        or rollout_replicas.sync_slots(inp, draft)
        # What the ranks reported becomes the status.
        or reports.record_progress(inp, draft)
        # Pods of another spec: a new gang, neither failure nor preemption.
        or spec_change.restart_on_spec_change(inp, draft)
        # Every pod done and every refit reported: succeed.
        or success_policy.succeed_when_done(inp, draft)
        # A partly created, adopted gang: create the rest into the same epoch.
        or adoption.create_the_missing_pods(inp, draft)
        # A failure no restart can cure: fail at once.
        or failure_policy.fail_not_retryable(inp, draft)
        # startDeadlineSeconds ran out before the gang was Ready: restart, counted.
        or start_deadline.fail_late_start(inp, draft)
        # A failed or lost rollout replica is replaced alone (maxReplacements).
        or rollout_replicas.replace_lost(inp, draft)
        # Pods of ranks a scale-down removed go once they left at a refit boundary.
        or rollout_replicas.retire_removed(inp, draft)
        # A policy failure restarts the policy gang (maxRestarts); a disruption too, as a
        # preemption.
        or failure_policy.restart_on_failure(inp, draft)
        # Pods of older epochs and generations go.
        or gang_creation.delete_old_epochs(inp, draft)
        # Replacements and scaled-up ranks join the running epoch.
        or rollout_replicas.create_due(inp, draft)
        # No gang in this epoch yet: create it once the old one is gone and backoff over.
        or gang_creation.create_gang(inp, draft)
        # Every rank published: open the rendezvous barrier.
        or gates.open_barrier(inp, draft)
        # Every pod exists: take the gang's scheduling gate off all of them.
        or gates.lift_gates(inp, draft)
        # Running once every pod is Ready.
        or gates.mark_ready(inp, draft)
    )
