"""What one reconcile round looked at, read once: the :class:`RoundInput` every policy
step decides from, and which none of them changes.

It holds the typed spec, what was observed, and what follows from them before any step
runs: the pods of the current epoch and of older ones, whether the epoch's gang exists
(recorded, or found after a lost status write), the rendezvous read for that epoch, which
ranks reported done, and which pods of the epoch are missing.

Must not import: kopf, kubernetes, aiohttp.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from refit_operator import names
from refit_operator.core import progress
from refit_operator.core.coordinate import Coordination, coordinate
from refit_operator.core.decision import JobView
from refit_operator.core.observe import Observed, ObservedPod
from refit_operator.models import RefitJobSpec, RefitJobStatus
from refit_operator.render import RenderOptions
from refit_worker.contract.rendezvous import LivePod, ProgressSummary
from refit_worker.contract.roles import ROLES


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
    current: tuple[ObservedPod, ...]
    stale: tuple[ObservedPod, ...]
    #: Pods of the epoch exist that the status does not record (a lost status write).
    adopted: bool
    #: The epoch's gang was created (recorded in the status, or adopted).
    created: bool
    #: The epoch's rendezvous, read when its gang was created.
    coordination: Coordination | None
    #: Pods whose rank reported done (such a pod may go: a drained node).
    done: frozenset[str]
    #: Pods of the epoch that do not exist and did not report done, in name order.
    absent: tuple[str, ...]
    #: Whether the gang's work is over, and why it fell short if it did.
    over: bool
    short: str | None

    @property
    def summary(self) -> ProgressSummary | None:
        return self.coordination.progress if self.coordination is not None else None

    @property
    def fills_adopted_gang(self) -> bool:
        """A lost round's creates ran in parallel and only some landed; before the barrier
        opens no rank has moved a byte, so the rest are created into the same epoch."""
        barrier_open = self.coordination is not None and self.coordination.barrier_open
        return self.adopted and bool(self.absent) and not barrier_open

    @property
    def failures(self) -> list[str]:
        """Why pods of the epoch failed on their own, and a gang that fell short."""
        failed = [p.failure for p in self.current if p.failure]
        return failed + ([self.short] if self.short else [])

    @property
    def disruptions(self) -> list[str]:
        """Why pods of the epoch are being taken away, or went missing; a drain of a pod
        whose rank already reported done takes nothing away."""
        taken = [
            f"{p.name}: {p.disruption}"
            for p in self.current
            if p.disruption and p.name not in self.done
        ]
        return taken + [f"{name}: PodMissing" for name in self.lost]

    @property
    def first_disrupted(self) -> ObservedPod | None:
        return next((p for p in self.current if p.disruption), None)

    @property
    def lost(self) -> tuple[str, ...]:
        """Pods of a created gang that went missing (counted as preempted)."""
        return () if not self.created or self.fills_adopted_gang else self.absent


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
    """The round's input, from the status it starts from (``start``)."""
    epoch = start.epoch
    current = tuple(p for p in observed.pods if p.epoch == epoch)
    adopted = bool(current) and start.created_epoch != epoch
    created = start.created_epoch == epoch or adopted
    coordination = _read_rendezvous(job, spec, observed, current, epoch) if created else None
    summary = coordination.progress if coordination is not None else None
    done = frozenset(
        names.pod_name(job.ref.name, role, rank) for role, rank in (summary.done if summary else ())
    )
    expected = {
        names.pod_name(job.ref.name, role, rank)
        for role in ROLES
        for rank in range(spec.policy.replicas if role == "policy" else spec.rollout.replicas)
    }
    over, short = (
        progress.finished(job.ref.name, spec, current, summary) if created else (False, None)
    )
    return RoundInput(
        job=job,
        spec=spec,
        observed=observed,
        now=now,
        options=options,
        retry=retry,
        epoch=epoch,
        current=current,
        stale=tuple(p for p in observed.pods if p.epoch != epoch),
        adopted=adopted,
        created=created,
        coordination=coordination,
        done=done,
        absent=tuple(sorted(expected - {p.name for p in current} - done)),
        over=over,
        short=short,
    )


def _read_rendezvous(
    job: JobView,
    spec: RefitJobSpec,
    observed: Observed,
    current: tuple[ObservedPod, ...],
    epoch: int,
) -> Coordination:
    # A pod being deleted or failed holds its rank no more: what it wrote is no member's.
    # (Generation 0 for all: rollout pods are recreated with the gang until rollout
    # replicas are their own failure domain.)
    live = {
        (p.role, p.rank): LivePod(p.uid, 0, running=p.phase == "Running")
        for p in current
        if p.role in ROLES and p.uid and not p.deleting and p.failure is None
    }
    return coordinate(
        job.ref.name,
        observed.entries,
        epoch=epoch,
        world=(spec.policy.replicas, spec.rollout.replicas),
        live=live,
    )
