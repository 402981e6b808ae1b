"""A failure domain: what stops, is counted and comes back as one.  The policy gang is one
(its ranks are one collective), and so is each rollout slot (one rank, replaced alone);
docs/failure-domains.md says why.

:class:`FailureDomain` is the one shape both are handled in: its incarnation (the gang's
epoch, the slot's generation: a new one is a new set of pod names), its failures (the
gang's restarts, counted against ``maxRestarts``; the slot's failures in a row, which its
backoff doubles by), its preemptions, and when it may come back.  It is a view over the
status fields each already has (the status schema, and so the CRD, is the models', and
stays as it is): :func:`policy_gang` and :func:`rollout_slot` read one, and
:func:`policy_gang_fields` and :func:`rollout_slot_fields` say what to write back.  A
slot's preemptions have no field of their own (they show in ``rollout.replacements``):
its view reads 0 and its write leaves them out.

Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from refit_operator.api.models import RefitJobStatus, RolloutReplica
from refit_operator.core.backoff import doubling


@dataclass(frozen=True, kw_only=True)
class FailureDomain:
    """One failure domain as it stands; each stop gives the next one."""

    #: The epoch (policy gang) or generation (rollout slot) now asked for.
    incarnation: int
    #: Failures counted (the gang's restarts; the slot's failures in a row).
    failures: int
    #: Preemptions counted (the gang's; 0 for a slot, which records none).
    preemptions: int
    #: Not before this time does the next incarnation start (None: at once).
    next_retry: datetime | None

    def backoff(self, first: float, cap: float) -> float:
        """The wait before the next incarnation if it stops now for a failure: ``first``
        doubled per failure counted before this one, at most ``cap``."""
        return doubling(first, cap, self.failures + 1)

    def failed(self, now: datetime, wait: float) -> FailureDomain:
        """Stopped for a failure: counted, the next incarnation after ``wait`` seconds."""
        return self._next(now, wait, failures=self.failures + 1)

    def preempted(self, now: datetime, wait: float) -> FailureDomain:
        """Stopped for a preemption (drain, eviction, a lost node): counted apart."""
        return self._next(now, wait, preemptions=self.preemptions + 1)

    def restarted(self, now: datetime, wait: float) -> FailureDomain:
        """Stopped for neither (a spec change): nothing counted."""
        return self._next(now, wait)

    def _next(self, now: datetime, wait: float, **counts: int) -> FailureDomain:
        retry = now + timedelta(seconds=wait)
        return replace(self, incarnation=self.incarnation + 1, next_retry=retry, **counts)

    def waits(self, now: datetime) -> float | None:
        """Seconds until the incarnation may start (None: it may now)."""
        if self.next_retry is None or now >= self.next_retry:
            return None
        return (self.next_retry - now).total_seconds()


def policy_gang(status: RefitJobStatus) -> FailureDomain:
    """The policy gang: ``epoch``, ``restarts``, ``preemptions``, ``restartAt``."""
    return FailureDomain(
        incarnation=status.epoch,
        failures=status.restarts,
        preemptions=status.preemptions,
        next_retry=status.restart_at,
    )


def policy_gang_fields(domain: FailureDomain) -> dict[str, Any]:
    """The status fields that record the policy gang (a ``Draft.update``'s changes)."""
    return {
        "epoch": domain.incarnation,
        "restarts": domain.failures,
        "preemptions": domain.preemptions,
        "restart_at": domain.next_retry,
    }


def rollout_slot(replica: RolloutReplica) -> FailureDomain:
    """A rollout slot: its ``generation``, ``failures`` in a row and ``replaceAt``."""
    return FailureDomain(
        incarnation=replica.generation,
        failures=replica.failures,
        preemptions=0,
        next_retry=replica.replace_at,
    )


def rollout_slot_fields(domain: FailureDomain) -> dict[str, Any]:
    """The fields of its ``rolloutReplicas`` entry that record a slot (a ``model_copy``'s
    update); its preemptions have none."""
    return {
        "generation": domain.incarnation,
        "failures": domain.failures,
        "replace_at": domain.next_retry,
    }
