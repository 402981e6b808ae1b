"""The pure reconcile: from a RefitJob and its observed children to actions and the next
status, decided in named stages (``stages.py``) of policy steps (``steps/``), each step in
a module named for what it decides; the policy that ends the round's decision says how
(an :class:`~refit_operator.core.phases.Outcome`), and the outcome is mapped to the phase.

Failure domains (docs/failure-domains.md): a rollout replica that fails or is disrupted
(DisruptionTarget, eviction, deletion, a preempted exit, a lost node, gone missing) is
replaced alone under its next generation, the policy pods untouched; failures use up
``rollout.failurePolicy.maxReplacements``.  A policy pod that fails or is disrupted
stops the policy gang: the epoch goes up, the rendezvous is cleared of all but the
serving rollout replicas' entries, and after a backoff the policy gang is recreated once
its old pods are gone; failures use up ``maxRestarts``, preemptions are counted apart.
A spec change (other than ``rollout.replicas``), a late start and a suspend stop every
pod; a failure the worker marks as not retryable fails the job at once.

The local runner drives this without an API.
"""

from __future__ import annotations

from datetime import datetime

from refit_operator.api.models import managed_elsewhere
from refit_operator.core import lost_nodes, stages
from refit_operator.core.decision import Decision, JobView
from refit_operator.core.draft import Draft
from refit_operator.core.observe import Observed
from refit_operator.core.phases import Outcome, phase_of
from refit_operator.core.refusal import refuse
from refit_operator.core.round_input import RoundInput, read_round
from refit_operator.core.steps import closing, time_limits, validity
from refit_operator.render.pods import RenderOptions


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
    outcome = decide(inp, draft)
    # Whatever the steps decided: pods on lost nodes are announced, force-deleted when out
    # of service, and a not-ready node's bound is waited out.
    lost_nodes.act(observed, draft, current=[p.name for p in inp.current])
    new = phase_of(outcome, current=job.status.phase, retry_invalid=retry)
    closing.close_round(inp, draft, old=job.status.phase, new=new)
    time_limits.expire(draft, job.basics.ttl_seconds_after_finished, new)
    return draft.decision()


def decide(inp: RoundInput, draft: Draft) -> Outcome:
    """The round's stages in order (``stages.py``): what always runs, whether the job runs
    at all, what the round found as status, the policies that may end the round, and the
    way forward, which always ends it."""
    stages.account(inp, draft)
    settled = stages.settle(inp, draft)
    if settled is not None:
        return settled
    stages.record(inp, draft)
    return stages.police(inp, draft) or stages.advance(inp, draft)
