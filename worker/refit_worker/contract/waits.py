"""Bounded waits: polling with back-off, a deadline, and a sentence saying what was awaited.

Nothing in kube-refit waits forever: every wait goes through :func:`poll_until` (threads)
or :func:`apoll_until` (asyncio).  Both call ``check`` until it returns a value other than
``None``/``False``, sleep between calls along a :class:`Backoff`, and raise ``error(text)``
naming ``what`` once ``timeout`` seconds are spent, or :class:`WaitCancelled` when
``cancel.is_set()``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

T = TypeVar("T")


class WaitTimeout(TimeoutError):
    """A wait ran past its deadline; the message says what it waited for."""


class WaitCancelled(Exception):
    """A wait was given up because its cancel flag was set (e.g. a stop signal)."""


class CancelFlag(Protocol):
    """Anything with ``is_set()``: a ``threading.Event``, a signal handler's flag..."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Backoff:
    """Sleeps that start at ``first`` and double up to ``cap``.

    ``spin``: seconds of re-checks without sleeping before the first sleep; a short spin
    catches events that finish within microseconds without paying a scheduler tick.
    """

    first: float = 1e-3
    cap: float = 0.5
    spin: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.cap:
            raise ValueError(f"Backoff needs 0 < first <= cap, got {self.first} and {self.cap}")
        if self.spin < 0:
            raise ValueError(f"Backoff.spin must be >= 0, got {self.spin}")

    def delays(self) -> Iterator[float]:
        delay = self.first
        while True:
            yield delay
            delay = min(delay * 2, self.cap)


ErrorFactory = Callable[[str], BaseException]


def _done(value: object) -> bool:
    return value is not None and value is not False


def _timed_out(what: str, timeout: float) -> str:
    return f"timed out after {timeout:g}s waiting for {what}"


def _waiting(
    check: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    backoff: Backoff,
    cancel: CancelFlag | None,
    error: ErrorFactory,
    clock: Callable[[], float],
) -> Generator[float, None, T]:
    """The one waiting rule, for both loops: yields how long to pause before the next check
    (0.0 while spinning) and returns the result; raises on timeout or cancel."""
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0, got {timeout}")
    start = clock()
    deadline = start + timeout
    spin_until = start + backoff.spin
    delays = backoff.delays()
    while True:
        result = check()
        if _done(result):
            return result  # type: ignore[return-value]  # not None/False: a T
        if cancel is not None and cancel.is_set():
            raise WaitCancelled(f"stopped waiting for {what}: cancelled")
        now = clock()
        if now >= deadline:
            raise error(_timed_out(what, timeout))
        yield 0.0 if now < spin_until else min(next(delays), deadline - now)


def poll_until(
    check: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    backoff: Backoff = Backoff(),
    cancel: CancelFlag | None = None,
    error: ErrorFactory = WaitTimeout,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``check`` until it returns a result; blocks the calling thread."""
    steps = _waiting(
        check,
        timeout=timeout,
        what=what,
        backoff=backoff,
        cancel=cancel,
        error=error,
        clock=clock,
    )
    while True:
        try:
            pause = next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]  # the generator's T
        if pause > 0:
            sleep(pause)


#: Below this, asyncio cannot sleep: its selector rounds timeouts up to whole milliseconds.
ASYNCIO_TICK_S = 1e-3


async def precise_sleep(delay: float) -> None:
    """An asyncio sleep that honours sub-millisecond delays.

    ``asyncio.sleep(50e-6)`` really sleeps >= 1 ms (the event loop's selector rounds its
    timeout up), which adds a millisecond to every short wait.  A delay under
    :data:`ASYNCIO_TICK_S` therefore sleeps the thread itself (``time.sleep`` is precise to
    microseconds and frees the CPU and the GIL), then yields to the loop once; longer ones
    are ordinary asyncio sleeps.  Use it with a :class:`Backoff` whose ``cap`` bounds how
    long the loop can be held (e.g. 1 ms).
    """
    if delay < ASYNCIO_TICK_S:
        time.sleep(delay)
        await asyncio.sleep(0)
    else:
        await asyncio.sleep(delay)


async def apoll_until(
    check: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    backoff: Backoff = Backoff(),
    cancel: CancelFlag | None = None,
    error: ErrorFactory = WaitTimeout,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> T:
    """Like :func:`poll_until`, but yields to the event loop between checks.

    While spinning it yields with ``sleep(0)``, so other tasks still run.
    """
    steps = _waiting(
        check,
        timeout=timeout,
        what=what,
        backoff=backoff,
        cancel=cancel,
        error=error,
        clock=clock,
    )
    while True:
        try:
            pause = next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]  # the generator's T
        await sleep(pause)
