"""A rank's progress reports, published for every refit it sends or commits.

:class:`~refit_worker.RefitSession` owns one :class:`ProgressReporter`, so a user's
own trainer and server fill the job's ``status``, ``refit run``'s table and the metrics the
same way the demo worker does: figures come only from refits that really moved.
"""

from __future__ import annotations

import logging

from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.entries import ProgressState, RefitReport, Verification
from refit_worker.contract.progress import ProgressLog
from refit_worker.rendezvous import Member, RendezvousStore

log = logging.getLogger(__name__)


def default_verification(config: WorkerConfig) -> Verification:
    """What a rank's engine itself checks before a commit: integrity hashes when the
    transfer carries them, else the manifest; a policy rank commits nothing."""
    if config.role == "policy":
        return "none"
    return "checksums" if config.transfer.checksum else "manifest"


def checked_level(integrity: str | None) -> Verification:
    """What a rollout rank's engine checked of one refit: every byte against its hashes
    (``integrity``: the algorithm), or only the manifest."""
    return "checksums" if integrity is not None else "manifest"


class ProgressReporter:
    """Keeps this rank's :class:`ProgressLog` and writes it under its progress key."""

    def __init__(self, store: RendezvousStore, member: Member, config: WorkerConfig) -> None:
        self._store = store
        #: Whose key the reports go under (a rollout rank's epoch changes as it rejoins).
        self.member = member
        self._refits = config.transfer.refits
        self.log = ProgressLog(config.first_refit, verification=default_verification(config))

    def refit(
        self, refit_id: int, nbytes: int, seconds: float, verification: Verification | None
    ) -> RefitReport:
        """Account for a refit sent (policy) or committed (rollout) and publish it; the one
        that completes the job's count is reported ``done``."""
        report = self.log.record(refit_id, nbytes, seconds, verification)
        done = self.log.refits_completed >= self._refits
        verb = "sent" if self.member.role == "policy" else "committed"
        self.publish(
            "done" if done else "running",
            "all refits done" if done else f"refit {refit_id} {verb}",
        )
        return report

    def seeded(
        self,
        source: str,
        refit_id: int,
        *,
        nbytes: int,
        seconds: float,
        serving_s: float,
        verification: Verification | None,
    ) -> None:
        """Account for a refit seeded from peer ``source`` and committed, and publish it."""
        self.log.record_seed(
            source,
            refit_id,
            nbytes=nbytes,
            seconds=seconds,
            serving_s=serving_s,
            verification=verification,
        )
        done = self.log.refits_completed >= self._refits
        self.publish(
            "done" if done else "running",
            "all refits done" if done else f"refit {refit_id} seeded from {source}",
        )

    def finish(self) -> bool:
        """Report ``done`` if every refit of the job is accounted for (also when this gang
        had none left to do: a gang recreated after the last commit); else say nothing."""
        if self.log.refits_completed < self._refits:
            return False
        return self.publish("done", "all refits done")

    def publish(self, state: ProgressState, message: str = "") -> bool:
        """Write the report now; best effort (a later report carries the same totals)."""
        try:
            self._store.write_progress(self.member, **self.log.fields(state, message))
        except Exception as exc:  # the store's own errors name the key and the cause
            log.warning("could not report progress (%s): %s", state, exc)
            return False
        return True
