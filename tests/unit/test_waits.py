"""``refit_worker.contract.waits``: bounded polling, with a fake clock so nothing really sleeps."""

from __future__ import annotations

import asyncio
import threading

import pytest

from refit_worker.contract.waits import Backoff, WaitCancelled, WaitTimeout, apoll_until, poll_until


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


def counter(ready_after: int, value: object = "ok"):
    calls = {"n": 0}

    def check() -> object:
        calls["n"] += 1
        return value if calls["n"] > ready_after else None

    return check, calls


def test_returns_the_first_result_and_backs_off_doubling_to_the_cap() -> None:
    clock = FakeClock()
    check, calls = counter(5)
    got = poll_until(
        check,
        timeout=10,
        what="x",
        backoff=Backoff(first=0.1, cap=0.4),
        clock=clock,
        sleep=clock.sleep,
    )
    assert got == "ok"
    assert calls["n"] == 6
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.4, 0.4, 0.4])


def test_false_means_not_yet_but_other_falsy_results_are_results() -> None:
    clock = FakeClock()
    values = iter([False, None, 0])
    got = poll_until(lambda: next(values), timeout=5, what="x", clock=clock, sleep=clock.sleep)
    assert got == 0
    assert len(clock.sleeps) == 2


def test_timeout_names_what_it_waited_for_and_never_oversleeps() -> None:
    clock = FakeClock()
    with pytest.raises(WaitTimeout, match=r"timed out after 1s waiting for the barrier"):
        poll_until(
            lambda: None,
            timeout=1.0,
            what="the barrier",
            backoff=Backoff(first=0.3, cap=0.3),
            clock=clock,
            sleep=clock.sleep,
        )
    assert clock.now == pytest.approx(101.0)  # the last sleep was cut to the deadline


def test_a_custom_error_type_carries_the_message() -> None:
    class PeerTimeout(TimeoutError):
        pass

    clock = FakeClock()
    with pytest.raises(PeerTimeout, match="waiting for credit"):
        poll_until(
            lambda: None,
            timeout=0.01,
            what="credit",
            error=PeerTimeout,
            clock=clock,
            sleep=clock.sleep,
        )


def test_zero_timeout_checks_once() -> None:
    clock = FakeClock()
    check, _ = counter(0)
    assert poll_until(check, timeout=0, what="x", clock=clock, sleep=clock.sleep) == "ok"
    with pytest.raises(WaitTimeout):
        poll_until(lambda: None, timeout=0, what="x", clock=clock, sleep=clock.sleep)
    assert clock.sleeps == []


def test_cancel_flag_stops_the_wait() -> None:
    clock = FakeClock()
    flag = threading.Event()
    calls = {"n": 0}

    def check() -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            flag.set()

    with pytest.raises(WaitCancelled, match="waiting for peers"):
        poll_until(check, timeout=60, what="peers", cancel=flag, clock=clock, sleep=clock.sleep)
    assert calls["n"] == 3


def test_spin_rechecks_without_sleeping_first() -> None:
    ticks = iter(range(1000))
    slept: list[float] = []
    check, _ = counter(4)
    # Each clock read advances 1 µs; a 10 µs spin covers the first checks.
    got = poll_until(
        check,
        timeout=1,
        what="x",
        backoff=Backoff(first=0.001, cap=0.001, spin=10e-6),
        clock=lambda: next(ticks) * 1e-6,
        sleep=slept.append,
    )
    assert got == "ok"
    assert slept == []


@pytest.mark.parametrize("kwargs", [{"first": 0.0}, {"first": 2.0, "cap": 1.0}, {"spin": -1.0}])
def test_bad_backoff_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="Backoff"):
        Backoff(**kwargs)


def test_negative_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="timeout"):
        poll_until(lambda: 1, timeout=-1, what="x")


async def test_async_variant_yields_to_other_tasks() -> None:
    done = asyncio.Event()

    async def other() -> None:
        done.set()

    task = asyncio.create_task(other())
    got = await apoll_until(
        lambda: True if done.is_set() else None,
        timeout=5,
        what="the other task",
        backoff=Backoff(first=1e-4, cap=1e-3, spin=0.01),
    )
    assert got is True
    await task


async def test_async_timeout_and_sleeps_follow_the_backoff() -> None:
    clock = FakeClock()
    with pytest.raises(WaitTimeout, match="waiting for a notification"):
        await apoll_until(
            lambda: None,
            timeout=0.35,
            what="a notification",
            backoff=Backoff(first=0.1, cap=0.2),
            clock=clock,
            sleep=clock.asleep,
        )
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.05])


async def test_precise_sleep_sleeps_the_thread_below_asyncios_tick(monkeypatch) -> None:
    """asyncio.sleep(50e-6) takes >= 1 ms (its selector rounds up): a short delay must go
    to time.sleep (precise) and then yield once; a long one stays an asyncio sleep."""
    from refit_worker.contract import waits

    calls: list[tuple[str, float]] = []
    real_asleep = asyncio.sleep

    async def asleep(delay: float) -> None:
        calls.append(("asyncio", delay))
        await real_asleep(0)

    monkeypatch.setattr(waits.time, "sleep", lambda d: calls.append(("thread", d)))
    monkeypatch.setattr(waits.asyncio, "sleep", asleep)
    await waits.precise_sleep(50e-6)
    await waits.precise_sleep(2e-3)
    assert calls == [("thread", 50e-6), ("asyncio", 0), ("asyncio", 2e-3)]
