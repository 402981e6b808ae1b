"""What one reconcile round looked at, read once: the :class:`RoundInput` every policy
step decides from, and which none of them changes.

It holds the typed spec, what was observed, and what follows from them before any step
runs: the policy pods of the current epoch and the rollout slots (one per rank of the
desired replica count, each at its generation), pods of older incarnations, rollout pods
of ranks a scale-down removed, whether the epoch's policy gang exists (recorded, or found
after a lost status write), the rendezvous read for that epoch, which ranks reported
done, and which pods are missing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial

from refit_operator.api import names
from refit_operator.api.models import RefitJobSpec, RefitJobStatus
from refit_operator.core import claims, progress
from refit_operator.core.coordinate import RendezvousRead, read_rendezvous
from refit_operator.core.decision import Emit, JobView
from refit_operator.core.observe import Observed, ObservedPod
from refit_operator.render.pods import RenderOptions
from refit_worker.contract.rendezvous import PREEMPT_KEY, LivePod, PreemptNotice, ProgressSummary
from refit_worker.contract.roles import ROLES, Role


@dataclass(frozen=True)
class Slot:
    """One rollout rank: its current generation, and that generation's pod."""

    rank: int
    generation: int
    name: str
    #: The pod of this generation, when it exists.
    pod: ObservedPod | None
    #: Its pod was created (recorded in the status, or found).
    created: bool


@dataclass(frozen=True, kw_only=True)
class RoundInput:
    job: JobView
    spec: RefitJobSpec
    observed: Observed
    now: datetime
    options: RenderOptions
    #: The spec was found invalid, then changed: the job starts over as a new one would.
    retry: bool
    #: The epoch the round is about (a restart or suspend moves the next round's).
    epoch: int
    #: The policy pods of the epoch and the rollout slots' pods.
    current: tuple[ObservedPod, ...]
    #: One per rollout rank of the desired replica count, in rank order.
    slots: tuple[Slot, ...]
    #: Policy pods of older epochs, rollout pods of older generations.
    stale: tuple[ObservedPod, ...]
    #: Rollout pods of ranks at or over the desired count (a scale-down).
    leaving: tuple[ObservedPod, ...]
    #: Policy pods of the epoch exist that the status does not record (a lost status write).
    adopted: bool
    #: The epoch's policy gang was created (recorded in the status, or adopted).
    created: bool
    #: The epoch's rendezvous, read when its gang was created (its barrier is decided by
    #: the steps, :func:`~refit_operator.core.coordinate.decide_barrier`).
    rendezvous: RendezvousRead | None
    #: Pods whose rank reported done (such a pod may go: a drained node).
    done: frozenset[str]
    #: Policy pods of the epoch, and created rollout slots' pods, that do not exist and did
    #: not report done, in name order.
    absent: tuple[str, ...]
    #: Whether the gang's work is over, and why it fell short if it did.
    over: bool
    short: str | None
    #: Warning Events about preemptions no one attested (``claims.py``): the claims'
    #: pods are in ``current`` as what they are (a failure, or running).
    ignored_claims: tuple[Emit, ...] = ()

    @property
    def summary(self) -> ProgressSummary | None:
        return self.rendezvous.progress if self.rendezvous is not None else None

    @property
    def policy(self) -> tuple[ObservedPod, ...]:
        return tuple(p for p in self.current if p.role == "policy")

    @property
    def policy_absent(self) -> tuple[str, ...]:
        slot_names = {s.name for s in self.slots}
        return tuple(n for n in self.absent if n not in slot_names)

    @property
    def fills_adopted_gang(self) -> bool:
        """A lost round's creates ran in parallel and only some landed; before the barrier
        opens no rank has moved a byte, so the rest are created into the same epoch.  With
        a policy pod of the epoch absent the barrier opens only if it already did (a first
        opening needs every policy rank's pod), so what is read says it: the operator's own
        barrier of the epoch is in the map."""
        barrier_open = self.rendezvous is not None and self.rendezvous.previous is not None
        return self.adopted and bool(self.policy_absent) and not barrier_open

    @property
    def failures(self) -> list[str]:
        """Why policy pods of the epoch failed on their own, and a gang that fell short."""
        failed = [p.failure for p in self.policy if p.failure and p.node_lost is None]
        return failed + ([self.short] if self.short else [])

    @property
    def disruptions(self) -> list[str]:
        """Why policy pods of the epoch are being taken away, or went missing; a drain of a
        pod whose rank already reported done takes nothing away."""
        taken = [f"{p.name}: {p.taken}" for p in self.policy if p.taken and p.name not in self.done]
        return taken + [f"{name}: PodMissing" for name in self.lost]

    @property
    def first_disrupted(self) -> ObservedPod | None:
        return next((p for p in self.policy if p.taken), None)

    @property
    def lost(self) -> tuple[str, ...]:
        """Policy pods of a created gang that went missing (counted as preempted)."""
        return () if not self.created or self.fills_adopted_gang else self.policy_absent


def read_slots(
    job: str, spec: RefitJobSpec, observed: Observed, start: RefitJobStatus
) -> tuple[Slot, ...]:
    """The rollout slots: each rank at its recorded generation, or at a later one whose pod
    exists (created by a round whose status write was lost)."""
    recorded = {r.rank: r for r in start.rollout_replicas}
    out = []
    for rank in range(spec.rollout.replicas):
        rec = recorded.get(rank)
        generation = rec.generation if rec is not None else 0
        mine = [p for p in observed.pods if p.role == "rollout" and p.rank == rank]
        generation = max([generation, *(p.generation for p in mine)])
        pod = next((p for p in mine if p.generation == generation), None)
        made = rec is not None and rec.generation == generation and bool(rec.pod)
        name = names.pod_name(job, "rollout", rank, generation)
        out.append(Slot(rank, generation, name, pod, pod is not None or made))
    return tuple(out)


def read_round(
    job: JobView,
    spec: RefitJobSpec,
    observed: Observed,
    *,
    now: datetime,
    options: RenderOptions,
    start: RefitJobStatus,
    retry: bool,
) -> RoundInput:
    """The round's input, from the status it starts from (``start``), each claimed
    preemption of a pod judged first (``claims.py``): one no one attested is read again
    as what it is."""
    read = partial(_read, job, spec, now=now, options=options, start=start, retry=retry)
    inp = read(observed)
    vetted = claims.vet(
        inp.current,
        epoch=inp.epoch,
        notice=_notice(observed),
        reports=observed.entries.progress(),
        missing=bool(inp.lost) or any(_missing(inp, s) for s in inp.slots),
    )
    if not vetted.events:
        return inp
    by_name = {p.name: p for p in vetted.pods}
    pods = tuple(by_name.get(p.name, p) for p in observed.pods)
    seen = replace(observed, pods=pods)
    again = read(seen)
    return replace(again, ignored_claims=vetted.events)


def _missing(inp: RoundInput, slot: Slot) -> bool:
    """A created rollout slot whose pod is gone without its rank's report of done."""
    return slot.created and slot.pod is None and slot.name not in inp.done


def _notice(observed: Observed) -> PreemptNotice | None:
    """The operator's preemption notice (read only from its own map)."""
    found = observed.entries.entries.get(PREEMPT_KEY)
    return found if isinstance(found, PreemptNotice) else None


def _read(
    job: JobView,
    spec: RefitJobSpec,
    observed: Observed,
    *,
    now: datetime,
    options: RenderOptions,
    start: RefitJobStatus,
    retry: bool,
) -> RoundInput:
    epoch = start.epoch
    slots = read_slots(job.ref.name, spec, observed, start)
    policy = tuple(p for p in observed.pods if p.role == "policy" and p.epoch == epoch)
    current = policy + tuple(s.pod for s in slots if s.pod is not None)
    leaving = tuple(
        p for p in observed.pods if p.role == "rollout" and p.rank >= spec.rollout.replicas
    )
    adopted = bool(policy) and start.created_epoch != epoch
    created = start.created_epoch == epoch or adopted
    rendezvous = (
        _read_rendezvous(job, spec, observed, current, slots=slots, epoch=epoch)
        if created
        else None
    )
    summary = rendezvous.progress if rendezvous is not None else None
    expected = _expected(job.ref.name, spec, epoch, slots)
    done = frozenset(expected[key] for key in (summary.done if summary else ()) if key in expected)
    wanted = {name for (role, rank), name in expected.items() if role == "policy"}
    wanted |= {s.name for s in slots if s.created}
    by_key = {key: next((p for p in current if p.name == n), None) for key, n in expected.items()}
    over, short = progress.finished(spec, by_key, summary) if created else (False, None)
    return RoundInput(
        job=job,
        spec=spec,
        observed=observed,
        now=now,
        options=options,
        retry=retry,
        epoch=epoch,
        current=current,
        slots=slots,
        stale=tuple(p for p in observed.pods if p not in current and p not in leaving),
        leaving=leaving,
        adopted=adopted,
        created=created,
        rendezvous=rendezvous,
        done=done,
        absent=tuple(sorted(wanted - {p.name for p in current} - done)),
        over=over,
        short=short,
    )


def _expected(
    job: str, spec: RefitJobSpec, epoch: int, slots: tuple[Slot, ...]
) -> dict[tuple[Role, int], str]:
    """The pod name each rank of the round should have."""
    out: dict[tuple[Role, int], str] = {
        ("policy", rank): names.pod_name(job, "policy", rank, epoch)
        for rank in range(spec.policy.replicas)
    }
    out.update({("rollout", s.rank): s.name for s in slots})
    return out


def _read_rendezvous(
    job: JobView,
    spec: RefitJobSpec,
    observed: Observed,
    current: tuple[ObservedPod, ...],
    *,
    slots: tuple[Slot, ...],
    epoch: int,
) -> RendezvousRead:
    # A pod being deleted, failed or lost with its node holds its rank no more: what it
    # wrote is no member's.  A rollout pod is live at its own generation.
    live = {
        (p.role, p.rank): LivePod(p.uid, p.generation, running=p.phase == "Running")
        for p in current
        if p.role in ROLES and p.uid and not p.deleting and p.failure is None and p.taken is None
    }
    # A slot whose next pod is still to come holds no report: the replaced pod's bytes
    # are on the status already (rollout_replicas.py), and its refits are no more the
    # slot's.
    for slot in slots:
        if slot.pod is None and not slot.created:
            live[("rollout", slot.rank)] = LivePod("", slot.generation, running=False)
    # A gang created whole (every rollout pod with this epoch's policy gang) opens once
    # every slot published, as one failure domain did; after a policy restart the rollout
    # replicas already serve, and the epoch opens without waiting for one being replaced.
    whole = all(p.epoch == epoch for p in current if p.role == "rollout")
    return read_rendezvous(
        job.ref.name,
        observed.entries,
        epoch=epoch,
        world=(spec.policy.replicas, spec.rollout.replicas),
        live=live,
        whole_gang=whole,
    )
