"""A rank's running account of its refits, turned into its progress report.

The demo worker and :class:`~refit_worker.RefitSession` keep one
:class:`ProgressLog` per rank and publish :meth:`ProgressLog.fields` under the rank's
``progress.<role>.<rank>`` key after every refit, so the operator's status, ``refit run``'s
table and the metrics read the same figures whoever wrote the rank's code.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from refit_worker.contract.entries import (
    RECENT_REFITS,
    ProgressState,
    RefitReport,
    SeedReport,
    ServedVersion,
    Verification,
)


@dataclass
class ProgressLog:
    """Counts from ``first_refit`` (refits committed before this rank started) onwards."""

    first_refit: int = 0
    verification: Verification = "none"
    refits_completed: int = field(init=False)
    bytes_total: int = 0
    seconds_total: float = 0.0
    recent: deque[RefitReport] = field(default_factory=lambda: deque(maxlen=RECENT_REFITS))
    #: How this (rollout) pod came to serve: its first commit (see :class:`SeedReport`).
    seed: SeedReport | None = None
    #: Whether this pod stays after the last refit to seed late peers with it.
    seeding: bool = False
    #: The version this (rollout) pod serves: its last commit and that state's digest.
    serving: ServedVersion | None = None

    def __post_init__(self) -> None:
        if self.first_refit < 0:
            raise ValueError(f"first_refit must be >= 0, got {self.first_refit}")
        self.refits_completed = self.first_refit

    def record(
        self, refit: int, nbytes: int, seconds: float, verification: Verification | None = None
    ) -> RefitReport:
        """Account for one more refit, ``refit`` by its id.

        ``refits_completed`` becomes ``refit + 1`` (the last committed id + 1): a rollout
        rank that joined late and skipped refits it missed counts from the job's start
        like the others, and never goes back (an older id leaves it as it is)."""
        if refit < 0 or nbytes < 0:
            raise ValueError(f"a refit id and its bytes are >= 0, got {refit} and {nbytes}")
        report = RefitReport(refit=refit, bytes=nbytes, seconds=max(seconds, 0.0))
        self.recent.append(report)
        self.refits_completed = max(self.refits_completed, refit + 1)
        self.bytes_total += nbytes
        self.seconds_total += report.seconds
        if verification is not None:
            self.verification = verification
        return report

    def first_commit(
        self, source: str, refit: int, nbytes: int, *, seconds: float, serving_s: float
    ) -> None:
        """Say once how this pod came to serve: its first committed refit and its source."""
        if self.seed is None:
            self.seed = SeedReport(
                source=source,
                refit=refit,
                bytes=nbytes,
                seconds=max(seconds, 0.0),
                serving_s=max(serving_s, 0.0),
            )

    def record_seed(
        self,
        source: str,
        refit: int,
        *,
        nbytes: int,
        seconds: float,
        serving_s: float,
        verification: Verification | None = None,
    ) -> None:
        """A refit seeded from a peer and committed: it counts as committed, but not in
        ``bytes_total`` or ``recent`` (those are what the policy ranks sent)."""
        if refit < 0 or nbytes < 0:
            raise ValueError(f"a refit id and its bytes are >= 0, got {refit} and {nbytes}")
        self.refits_completed = max(self.refits_completed, refit + 1)
        self.first_commit(source, refit, nbytes, seconds=seconds, serving_s=serving_s)
        if verification is not None:
            self.verification = verification

    def fields(self, state: ProgressState = "running", message: str = "") -> dict[str, Any]:
        """Keyword arguments for ``RendezvousStore.write_progress``."""
        return {
            "state": state,
            "first_refit": self.first_refit,
            "refits_completed": self.refits_completed,
            "bytes_total": self.bytes_total,
            "seconds_total": self.seconds_total,
            "recent": tuple(self.recent),
            "verification": self.verification,
            "message": message[:200],
            "seed": self.seed,
            "seeding": self.seeding,
            "serving": self.serving,
        }
