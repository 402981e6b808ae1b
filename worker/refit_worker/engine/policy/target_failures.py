"""Per-target failure isolation of one refit on a policy rank.

A target whose transfer goes to ERR, that times out, aborts or declines, or that the
caller drops (:meth:`Delivery.drop`, e.g. it left the membership) is taken out of the refit
with its reason; the other targets complete.  Errors of this rank itself (a bad layout, a
local registration) are not caught here and fail the whole send.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from ..transport.agent import PeerError, RefitTimeoutError, WholeRefitWanted

T = TypeVar("T")


class TargetDropped(Exception):
    """Raised inside a wait on a target that was dropped meanwhile."""


#: What a target can do to a refit without it being this rank's failure.
TARGET_ERRORS = (PeerError, RefitTimeoutError, TargetDropped)


def _reason(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, TargetDropped) else f"{type(exc).__name__}: {exc}"


class Delivery:
    """Which targets (rollout ranks) of one refit were dropped, and why."""

    def __init__(self) -> None:
        self.dropped: dict[int, str] = {}
        #: Dropped targets that declined a delta and want this refit whole.
        self.wants_whole: set[int] = set()

    def drop(self, rank: int, reason: str) -> None:
        """Take ``rank`` out of the refit (the first reason is kept)."""
        self.dropped.setdefault(rank, reason)

    def live(self, rank: int) -> bool:
        return rank not in self.dropped

    def check(self, rank: int) -> None:
        """Inside a wait on ``rank``: stop waiting once it was dropped."""
        if rank in self.dropped:
            raise TargetDropped(self.dropped[rank])

    async def attempt(self, rank: int, step: Awaitable[T]) -> T | None:
        """Run one step of the refit for target ``rank``; a target error drops it."""
        try:
            return await step
        except TARGET_ERRORS as exc:
            self._failed(rank, exc)
            return None

    def attempt_now(self, rank: int, step: Callable[[], T]) -> T | None:
        """:meth:`attempt` for a step that does not wait."""
        try:
            return step()
        except TARGET_ERRORS as exc:
            self._failed(rank, exc)
            return None

    def _failed(self, rank: int, exc: BaseException) -> None:
        if isinstance(exc, WholeRefitWanted) and rank not in self.dropped:
            self.wants_whole.add(rank)
        self.drop(rank, _reason(exc))

    def delivered(self, ranks: Iterable[int]) -> tuple[int, ...]:
        """The ranks of ``ranks`` that were not dropped, in order."""
        return tuple(sorted(r for r in set(ranks) if r not in self.dropped))


__all__ = ["TARGET_ERRORS", "Delivery", "TargetDropped"]
