"""What :class:`~refit_worker.RefitSession` hands back and raises.

:class:`RefitStats` (one refit as this rank saw it), :class:`CommittedRefit`,
:class:`DeltaChanges` (what a delta refit changed), and the ways
a rank's membership ends besides a preemption: :class:`Removed` (a scale-down took its
rank away; it leaves cleanly) and :class:`Superseded` (another pod holds its rank: this
one is stale and must write nothing more).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from refit_worker.contract.entries import Verification
from refit_worker.rendezvous import Preempted

# A scale-down took this rollout rank out of the job: it reports ``left`` at a refit
# boundary and exits cleanly; the store's wait raises it too.
from refit_worker.rendezvous.store import Removed

StateDict = dict[str, torch.Tensor]
#: ``verify(refit_id, tensors)``: ``refit_id`` is the id of the refit that arrived.  It
#: raises to refuse the refit; it may return the level it reached for this refit, which
#: then replaces ``verified_as`` (None: as named).
Verifier = Callable[[int, StateDict], "Verification | None"]


@dataclass(frozen=True)
class RefitStats:
    """One refit as this rank saw it.

    ``seconds`` covers the transfer and the commit only: from the moment the transfer could
    start (a rollout rank: its landing memory was ready and it told the senders so; a
    policy rank: every receiver was ready) to the commit (a policy rank: every receiver
    confirmed).  Not included: waiting for the peer to start, generating or loading the
    weights, the caller's ``verify``, and control work before the transfer (checks, the
    first refit's allocation and registration of landing memory): ``control_seconds``.
    """

    refit_id: int
    #: Bytes this rank moved, as its engine counted them: a rollout rank, what landed; a
    #: policy rank, what it wrote, to each of its targets.
    bytes: int
    seconds: float
    #: Control work of the refit (checks, plans, allocating and registering memory).
    control_seconds: float = 0.0
    #: NIXL registrations the refit made (0 once memory is reused refit after refit).
    registrations: int = 0
    #: A policy rank: the rollout ranks that confirmed the refit (empty on a rollout rank).
    delivered: frozenset[int] = frozenset()
    #: A policy rank: the rollout ranks dropped from the refit, with the reason.
    dropped: tuple[tuple[int, str], ...] = ()

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class CommittedRefit:
    refit_id: int
    state: StateDict


@dataclass(frozen=True)
class DeltaChanges:
    """A refit that came as a delta: the version it was applied onto and the tensors it
    changed (by the sent names); every other tensor is that version's, bit for bit.  An
    engine that serves exactly ``base_refit`` need land only ``changed``."""

    base_refit: int
    changed: frozenset[str]


class Superseded(Preempted):
    """Another pod holds this rank's slot: this pod is stale (its replacement runs).  It
    reports nothing more (the rank's progress key is the replacement's now) and exits as
    preempted."""


class HandedOver(Superseded):
    """This pod was stopped (a drain, an eviction) and stayed until its replacement served
    (:meth:`~refit_worker.rollout.rollout_session.RolloutSession.hand_over`): a preemption,
    reported as nothing more under the rank's progress key, which is the replacement's now."""


class RefitUndelivered(RuntimeError):
    """A policy rank's refit reached no rollout member within the timeout."""


class _Flag:
    """A stop callable seen as a cancel flag for the store's waits."""

    def __init__(self, requested: Callable[[], bool]) -> None:
        self._requested = requested

    def is_set(self) -> bool:
        return self._requested()


__all__ = [
    "CommittedRefit",
    "HandedOver",
    "RefitStats",
    "RefitUndelivered",
    "Removed",
    "StateDict",
    "Superseded",
    "Verifier",
]
