"""The stages of a round's decision, in order (:data:`STAGES`); ``reconcile.decide`` runs
them.  Each calls its policy steps (``steps/``) in the order that decides priority:

1. :func:`account`: what always runs, whatever is decided after it: the bytes the
   rollout pods reported (a finished job's last reports too).
2. :func:`settle`: whether the job runs at all: a finished job stays finished, a suspended
   one stops, one past ``activeDeadlineSeconds`` fails.  Any of them ends the round.
3. :func:`record`: what the round found becomes the status and the job's fixed children
   exist: Services, ConfigMap and RBAC created, a gang a lost status write left unrecorded
   adopted, the rollout slots and the ranks' reports written.  Never ends the round.
4. :func:`police`: the policies that may end the round, highest first: a spec change, the
   job's success, a failure no restart cures, a late start, a rollout replica's
   replacement, a policy failure or preemption.
5. :func:`advance`: the way forward: old incarnations deleted, due rollout pods and the
   epoch's gang created (or waited for), the barrier opened, the scheduling gates lifted,
   and whether the gang is Ready: always the round's end.

A step that always runs is a statement returning None; a policy returns an
:class:`~refit_operator.core.phases.Outcome` when it ends the round.
"""

from __future__ import annotations

from refit_operator.core import byte_accounting
from refit_operator.core.draft import Draft
from refit_operator.core.phases import Outcome
from refit_operator.core.round_input import RoundInput
from refit_operator.core.steps import (
    adoption,
    failure_policy,
    gang_creation,
    gates,
    reports,
    rollout_replicas,
    settled,
    spec_change,
    static_children,
    success_policy,
    suspend,
    time_limits,
)


def account(inp: RoundInput, draft: Draft) -> None:
    """The bytes every rollout pod reported receiving, counted once per pod."""
    draft.status = byte_accounting.account(draft.status, inp.observed.entries.progress())


def settle(inp: RoundInput, draft: Draft) -> Outcome | None:
    # A finished job stays finished: stop what still runs of it.
    # spec.suspend: stop the gang, create nothing.
    # activeDeadlineSeconds ran out: fail.
    return (
        settled.keep_finished(inp, draft)
        or suspend.suspend(inp, draft)
        or time_limits.active_deadline(inp, draft)
    )


def record(inp: RoundInput, draft: Draft) -> None:
    # Services, the rendezvous ConfigMap, the workers' RBAC: create what is missing.
    static_children.create_missing(inp, draft)
    # Pods of the epoch that a lost status write did not record are the gang.
    adoption.adopt_unrecorded_gang(inp, draft)
    # The rollout slots (one per rank asked for, at its generation) as status.
    rollout_replicas.sync_slots(inp, draft)
    # What the replicas serve, by version: the ledger.
    rollout_replicas.sync_versions(inp, draft)
    # What the ranks reported becomes the status.
    reports.record_progress(inp, draft)


def police(inp: RoundInput, draft: Draft) -> Outcome | None:
    """The policies in priority order.  Two steps that always run sit between them, where
    their effects belong: an adopted gang's missing pods are created unless the spec
    changed or the job is done, before failures are judged; the pods of ranks a
    scale-down removed retire once the rollout replicas are judged, before a policy
    failure restarts the policy gang."""
    # A preemption no one attested (a pod's own exit code or report) is announced.
    failure_policy.announce_ignored_claims(inp, draft)
    # Pods of another spec: a new gang, neither failure nor preemption.
    # Every pod done and every refit reported: succeed.
    ended = spec_change.restart_on_spec_change(inp, draft) or success_policy.succeed_when_done(
        inp, draft
    )
    if ended is not None:
        return ended
    # A partly created, adopted gang: create the rest into the same epoch.
    adoption.create_the_missing_pods(inp, draft)
    # A failure no restart can cure: fail at once.
    # startDeadlineSeconds ran out before the gang was Ready: restart, counted.
    # A failed or lost rollout replica is replaced alone (maxReplacements).
    ended = (
        failure_policy.fail_not_retryable(inp, draft)
        or time_limits.fail_late_start(inp, draft)
        or rollout_replicas.replace_lost(inp, draft)
    )
    if ended is not None:
        return ended
    # Pods of ranks a scale-down removed go once they left at a refit boundary.
    rollout_replicas.retire_removed(inp, draft)
    # A policy failure restarts the policy gang (maxRestarts); a disruption too, as a
    # preemption.
    return failure_policy.restart_on_failure(inp, draft)


def advance(inp: RoundInput, draft: Draft) -> Outcome:
    # Pods of older epochs and generations go.
    gang_creation.delete_old_epochs(inp, draft)
    # Replacements and scaled-up ranks join the running epoch.
    rollout_replicas.create_due(inp, draft)
    # No gang in this epoch yet: create it once the old one is gone and backoff over.
    waiting = gang_creation.create_gang(inp, draft)
    if waiting is not None:
        return waiting
    # Every rank published: open the rendezvous barrier.
    gates.open_barrier(inp, draft)
    # Every pod exists: take the gang's scheduling gate off all of them.
    gates.lift_gates(inp, draft)
    # Running once every pod is Ready.
    return gates.mark_ready(inp, draft)


#: The stages by name, in the order ``reconcile.decide`` runs them.
STAGES = ("account", "settle", "record", "police", "advance")
