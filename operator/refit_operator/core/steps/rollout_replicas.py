"""Rollout replicas are their own failure domain: a rollout pod that fails, is disrupted,
goes missing or is lost with its node is replaced alone, under its rank's next
generation (a new name, so the replacement never waits for the pod it replaces); the
policy pods keep running.  Failures use up ``rollout.failurePolicy.maxReplacements``
(with a doubling backoff per failure of the same rank in a row), preemptions do not and
are replaced at once.  Scaling ``rollout.replicas`` adds slots, created at once, and
retires the pods of ranks over the count once they exited or reported ``left``.
"""

from __future__ import annotations

from typing import Any

from refit_operator.api import names
from refit_operator.api.models import RolloutReplica
from refit_operator.api.status import (
    UNSEEDED,
    Served,
    seed_words,
    version_conflicts,
    version_ledger,
    version_words,
)
from refit_operator.core import failure_domain
from refit_operator.core.decision import Create, Emit
from refit_operator.core.draft import Draft
from refit_operator.core.phases import Outcome
from refit_operator.core.round_input import RoundInput, Slot
from refit_operator.core.steps.restart import POLL_DELETING_S, stop_gang
from refit_operator.render import pods
from refit_worker.contract.rendezvous import ProgressEntry, SeedReport


def sync_slots(inp: RoundInput, draft: Draft) -> None:
    """``status.rolloutReplicas`` as the slots stand: one per rank of the desired count,
    each with its generation, pod, what it committed and how its pod came to serve; a
    pod's first seed seen is announced (``ReplicaSeeded``)."""
    recorded = {r.rank: r for r in draft.status.rollout_replicas}
    committed = _committed(inp)
    seeds = _seeds(inp)
    replicas = []
    for slot in inp.slots:
        rec = recorded.get(slot.rank) or RolloutReplica(rank=slot.rank)
        same = rec.generation == slot.generation
        ready = slot.pod is not None and slot.pod.ready
        last = committed.get(slot.rank, rec.last_committed_refit if same else 0)
        # A pod's first commit never changes: what is recorded of this generation stays.
        kept = _seed_of(rec) if same else {}
        seed = seeds.get(slot.rank)
        replica = RolloutReplica(
            rank=slot.rank,
            generation=slot.generation,
            pod=slot.name if slot.created else "",
            last_committed_refit=last,
            ready=ready,
            # A replica that came up Ready ends its rank's run of failures.
            failures=0 if ready else rec.failures,
            replace_at=rec.replace_at if same else None,
            **(kept or _seed_fields(seed)),
        )
        if not kept and seed is not None:
            draft.actions.append(Emit("Normal", "ReplicaSeeded", _seeded_message(replica)))
        replicas.append(replica)
    selector = names.rollout_selector(inp.job.ref.name)
    draft.update(rollout_replicas=replicas, rollout_selector=selector)


def _own_reports(inp: RoundInput) -> dict[int, ProgressEntry]:
    """Each slot's progress report from its own pod only (any epoch): the report a
    replaced pod left under the same key (another uid) says nothing of the pod there now."""
    uids = {s.pod.uid: s.rank for s in inp.slots if s.pod is not None and s.pod.uid}
    return {
        uids[e.uid]: e
        for e in inp.observed.entries.progress()
        if e.role == "rollout" and e.uid in uids
    }


def _committed(inp: RoundInput) -> dict[int, int]:
    """Each slot's last committed refit, from its own pod's progress report."""
    return {rank: e.refits_completed for rank, e in _own_reports(inp).items()}


def _seeds(inp: RoundInput) -> dict[int, SeedReport]:
    """Each slot's seed, from its own pod's progress report."""
    return {rank: e.seed for rank, e in _own_reports(inp).items() if e.seed is not None}


def _served(inp: RoundInput) -> dict[int, Served]:
    """What each slot's pod reports serving: (refit, digest, the key it passed)."""
    return {
        rank: (e.serving.refit, e.serving.digest, e.serving.signed_by)
        for rank, e in _own_reports(inp).items()
        if e.serving is not None
    }


def sync_versions(inp: RoundInput, draft: Draft) -> None:
    """``status.versions`` from what the slots' pods serve; replicas that serve one refit
    with different digests are announced (``VersionMismatch``) when the ledger changes."""
    served = _served(inp)
    ledger = version_ledger(served)
    # No report at all (the rendezvous gone with a finished job) says nothing new.
    if not served or ledger == draft.status.versions:
        return
    for refit in version_conflicts(ledger):
        rows = [row for row in ledger if row.refit == refit]
        words = "; ".join(version_words(rows))
        message = f"replicas serve refit {refit} with different weights: {words}"
        draft.actions.append(Emit("Warning", "VersionMismatch", message))
    draft.update(versions=ledger)


def _seed_of(rec: RolloutReplica) -> dict[str, Any]:
    """The seed fields recorded of ``rec`` ({}: none recorded)."""
    if rec.seeded_from is None:
        return {}
    return {field: getattr(rec, field) for field in UNSEEDED}


def _seed_fields(seed: SeedReport | None) -> dict[str, Any]:
    if seed is None:
        return {}
    return {
        "seeded_from": seed.source,
        "seeded_refit": seed.refit,
        "seeded_bytes": seed.bytes,
        "seeded_seconds": seed.seconds,
        "seconds_to_serving": seed.serving_s,
    }


def _seeded_message(replica: RolloutReplica) -> str:
    """``rollout-1 (pod job-rollout-1-g1) seeded from rollout-0: refit 3, 1.2 MB in
    0.05 s, serving 2.3 s after its start``."""
    return f"rollout-{replica.rank} (pod {replica.pod or '-'}) {seed_words(replica)}"


def _why(inp: RoundInput, slot: Slot) -> tuple[str, bool] | None:
    """Why the slot's replica must be replaced, and whether it failed (else: disrupted)."""
    pod = slot.pod
    if slot.name in inp.done or (pod is not None and pod.phase == "Succeeded"):
        return None  # its work is on record
    if pod is None:
        return (f"{slot.name}: PodMissing", False) if slot.created else None
    if pod.failure and pod.node_lost is None:
        # Beside a disruption of the policy gang, the replica's transfer broke because its
        # sender stopped: a preemption's knock-on, replaced at once and not counted.
        return pod.failure, not inp.disruptions
    if pod.taken:
        return f"{pod.name}: {pod.taken}", False
    return None


def replace_lost(inp: RoundInput, draft: Draft) -> Outcome | None:
    """Replace each failed, disrupted or missing rollout replica alone; fail the job once
    failures used up ``maxReplacements``."""
    limit = inp.spec.rollout_failure_policy.max_replacements
    for slot in inp.slots:
        found = _why(inp, slot)
        if found is None:
            continue
        why, failed = found
        if failed and draft.status.rollout_failures >= limit:
            stop_gang(inp, draft)
            message = f"{why}; rollout.failurePolicy.maxReplacements ({limit}) used up"
            draft.fail("ReplacementsExhausted", message)
            return Outcome.RESTARTS_EXHAUSTED
        _replace(inp, draft, slot, why, failed=failed)
    return None


def _replace(inp: RoundInput, draft: Draft, slot: Slot, why: str, *, failed: bool) -> None:
    status = draft.status
    old = next(r for r in status.rollout_replicas if r.rank == slot.rank)
    # The slot's failure domain (sync_slots put it at the slot's generation this round).
    domain = failure_domain.rollout_slot(old)
    if failed:
        policy = inp.spec.rollout_failure_policy
        delay = domain.backoff(policy.backoff_seconds, policy.max_backoff_seconds)
        domain = domain.failed(inp.now, delay)
    else:  # a preemption is replaced at once, and not counted against the rank
        delay = 0.0
        domain = domain.preempted(inp.now, delay)
    fields = failure_domain.rollout_slot_fields(domain)
    # The replacement has its own first commit to report: the old pod's seed goes.
    new = old.model_copy(update={**fields, **UNSEEDED, "pod": "", "ready": False})
    replicas = [new if r.rank == slot.rank else r for r in status.rollout_replicas]
    count = status.rollout.replacements + 1
    draft.update(
        rollout_replicas=replicas,
        rollout=status.rollout.model_copy(update={"replacements": count}),
        rollout_failures=status.rollout_failures + (1 if failed else 0),
    )
    if slot.pod is not None:
        draft.delete_pods([slot.pod])
    name = names.pod_name(inp.job.ref.name, "rollout", slot.rank, slot.generation + 1)
    message = f"rollout rank {slot.rank} replaced by {name} (replacement {count}): {why}"
    draft.actions.append(Emit("Warning" if failed else "Normal", "RolloutReplaced", message))
    draft.later(max(delay, POLL_DELETING_S))


def retire_removed(inp: RoundInput, draft: Draft) -> None:
    """Pods of ranks a scale-down removed go once they exited, reported ``left``, never
    started, or lost their node; until then they finish the refit they are in."""
    left = {e.uid for e in inp.observed.entries.progress() if e.state == "left"}
    going = [p for p in inp.leaving if p.gone or p.phase == "Pending" or p.uid in left]
    draft.delete_pods(going)
    if len(going) < len(inp.leaving):
        draft.later(POLL_DELETING_S)


def due(inp: RoundInput, draft: Draft) -> dict[int, int]:
    """The slots whose pod is to be created now (rank -> generation); asks to look again
    when a replacement's backoff runs out."""
    existing = {(p.rank, p.generation) for p in inp.observed.pods if p.role == "rollout"}
    out: dict[int, int] = {}
    for rec in draft.status.rollout_replicas:
        if rec.pod or (rec.rank, rec.generation) in existing:
            continue
        wait = failure_domain.rollout_slot(rec).waits(inp.now)
        if wait is not None:  # a replacement's backoff still runs
            draft.later(wait)
            continue
        out[rec.rank] = rec.generation
    return out


def rollout_pods(
    inp: RoundInput, draft: Draft, slots: dict[int, int], *, policy: bool
) -> list[Create]:
    """The creates of ``slots`` (with the epoch's policy gang when ``policy``), recorded as
    created in the status."""
    status = draft.status
    leader = next((r.generation for r in status.rollout_replicas if r.rank == 0), 0)
    objs = pods.render_gang(
        inp.job.ref,
        inp.spec,
        status.epoch,
        inp.options,
        status.refits_completed,
        policy=policy,
        rollout=slots,
        rollout_leader=leader,
    )
    job = inp.job.ref.name
    replicas = [
        r.model_copy(update={"pod": names.pod_name(job, "rollout", r.rank, r.generation)})
        if r.rank in slots
        else r
        for r in status.rollout_replicas
    ]
    draft.update(rollout_replicas=replicas)
    return [Create(o) for o in objs]


def create_due(inp: RoundInput, draft: Draft) -> None:
    """Replacements and new ranks of a scale-up join the running epoch (at its next refit
    boundary); while the policy gang is being recreated they come with it."""
    if not inp.created:
        return
    slots = due(inp, draft)
    if slots:
        draft.actions.extend(rollout_pods(inp, draft, slots, policy=False))
