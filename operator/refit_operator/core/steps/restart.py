"""How a gang stops and starts again in a new epoch (shared by the spec-change, start
deadline and failure policies): the policy gang stops (``scope="policy"``: a policy pod
failed or was disrupted; the rollout replicas keep serving and join the new epoch), or
every pod does (``scope="job"``: a spec change, a late start; every rollout slot moves to
its next generation); the epoch goes up, and after a backoff the gang is recreated.
Failures use up ``maxRestarts`` (doubling backoff); preemptions are counted apart, up to
``maxPreemptions``; a spec change is neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Literal

from refit_operator.api.models import RolloutReplica
from refit_operator.api.status import UNSEEDED
from refit_operator.core import conditions as cond
from refit_operator.core import failure_domain
from refit_operator.core.coordinate import preempt_notice
from refit_operator.core.decision import Delete, Emit
from refit_operator.core.draft import Draft
from refit_operator.core.observe import ObservedPod
from refit_operator.core.phases import Outcome
from refit_operator.core.round_input import RoundInput
from refit_operator.render import gang

#: How soon to look again while old pods are still going away.
POLL_DELETING_S = 1.0


def drop_pod_group(inp: RoundInput, draft: Draft) -> None:
    """The epoch's PodGroup goes with its gang (``admission: PodGroup``)."""
    api = gang.pod_group_api(inp.spec.gang)
    if api is not None:
        name = gang.pod_group_name(inp.job.ref.name, draft.status.epoch)
        draft.actions.append(Delete(api, "PodGroup", name))


def stop_gang(inp: RoundInput, draft: Draft) -> None:
    draft.delete_pods(inp.observed.pods)
    drop_pod_group(inp, draft)


def reset_slots(inp: RoundInput, draft: Draft, at: datetime | None) -> None:
    """Every rollout slot whose pod was created to its next generation, its pod created at
    ``at`` or later (the whole job stopped: a suspend, a spec change, a late start); no
    replacement counted."""
    recorded = {r.rank: r for r in draft.status.rollout_replicas}
    replicas = []
    for slot in inp.slots:
        rec = recorded.get(slot.rank) or RolloutReplica(rank=slot.rank, generation=slot.generation)
        generation = max(rec.generation, slot.generation + (1 if slot.created else 0))
        # The new pod reports its own first commit: the old pod's seed goes.
        update = {"generation": generation, "pod": "", "ready": False, "replace_at": at}
        update |= UNSEEDED
        replicas.append(rec.model_copy(update=update))
    draft.update(rollout_replicas=replicas)


Scope = Literal["policy", "job"]


def restart_gang(
    inp: RoundInput,
    draft: Draft,
    *,
    failures: Sequence[str] = (),
    disruptions: Sequence[str] = (),
    notice_from: ObservedPod | None = None,
    scope: Scope = "job",
    reason: str = "RestartsExhausted",
) -> Outcome:
    """Stop the gang (of ``scope``); fail the job once ``maxRestarts`` is used up (the
    Failed condition's ``reason``), else move to the next epoch, recreated after the
    backoff."""
    if notice_from is not None and disruptions and not failures:
        # Ranks hear the notice and stop at a safe point, ahead of their own signals.
        notice = preempt_notice(
            inp.job.ref.name,
            epoch=draft.status.epoch,
            pod=notice_from.name,
            uid=notice_from.uid,
            reason=disruptions[0],
            role="policy" if scope == "policy" else None,
        )
        if notice is not None:
            draft.actions.append(notice)
    limit = inp.spec.failure_policy.max_restarts
    exhausted = bool(failures) and draft.status.restarts >= limit
    bound = inp.spec.failure_policy.max_preemptions
    preempted_out = not failures and bool(disruptions) and draft.status.preemptions >= bound
    if scope == "policy" and not (exhausted or preempted_out):
        draft.delete_pods(p for p in inp.observed.pods if p.role == "policy")
        drop_pod_group(inp, draft)
    else:  # the job fails, or restarts whole: nothing of it keeps running
        stop_gang(inp, draft)
    if exhausted:
        draft.fail(reason, f"{failures[0]}; maxRestarts ({limit}) used up")
        return Outcome.RESTARTS_EXHAUSTED
    if preempted_out:
        draft.fail(
            "PreemptionsExhausted",
            f"{disruptions[0]}; the policy gang was preempted {draft.status.preemptions} "
            f"times: maxPreemptions ({bound}) used up",
        )
        return Outcome.RESTARTS_EXHAUSTED
    reason, message, delay = _count(inp, draft, failures, disruptions, scope)
    draft.update(created_epoch=None, epoch_start_time=None, message=message)
    if scope == "job":
        reset_slots(inp, draft, draft.status.restart_at)
    draft.condition(cond.RESTARTING, "True", reason, message)
    draft.actions.append(Emit("Warning", reason, message))
    draft.later(max(delay, POLL_DELETING_S))
    return Outcome.GANG_DISRUPTED


def _count(
    inp: RoundInput,
    draft: Draft,
    failures: Sequence[str],
    disruptions: Sequence[str],
    scope: Scope,
) -> tuple[str, str, float]:
    """Count the restart or preemption in the policy gang's failure domain (its next
    epoch, after the backoff): the reason, the message and the backoff."""
    gang_word = "policy gang" if scope == "policy" else "gang"
    policy = inp.spec.failure_policy
    domain = failure_domain.policy_gang(draft.status)
    if failures:
        delay = domain.backoff(policy.backoff_seconds, policy.max_backoff_seconds)
        domain = domain.failed(inp.now, delay)
        reason, message = "Restarted", f"{gang_word} restart {domain.failures}: {failures[0]}"
    elif disruptions:
        delay = float(policy.backoff_seconds)
        domain = domain.preempted(inp.now, delay)
        reason = "Preempted"
        message = f"{gang_word} preempted ({domain.preemptions}): {disruptions[0]}"
    else:
        delay = 0.0
        domain = domain.restarted(inp.now, delay)
        reason, message = "SpecChanged", "the spec changed; recreating the gang"
    draft.update(**failure_domain.policy_gang_fields(domain))
    return reason, message, delay
