"""Leader election decisions (``refit_operator.shell.lease``): who may take a Lease and when, what
each move writes, and which timings are refused.  All pure: records and clocks are given.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from refit_operator.shell.lease import Move, Record, Timing, decide, next_record, released

ME, OTHER = "operator-a_1", "operator-b_2"
NOW = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
HELD = Record(OTHER, 15, "2026-01-02T03:00:00.000000Z", "2026-01-02T03:04:00.000000Z", 4)


@pytest.mark.parametrize(
    ("record", "observed_at", "now", "move"),
    [
        pytest.param(None, 0.0, 0.0, Move.CREATE, id="no-lease"),
        pytest.param(HELD, 100.0, 100.0, Move.WAIT, id="just-renewed-by-other"),
        pytest.param(HELD, 100.0, 114.9, Move.WAIT, id="other-still-within-its-duration"),
        pytest.param(HELD, 100.0, 115.0, Move.TAKE, id="other-expired-by-our-clock"),
        pytest.param(Record(ME, 15, "a", "b", 4), 100.0, 100.0, Move.RENEW, id="ours"),
        pytest.param(Record(ME, 15, "a", "b", 4), 0.0, 1e6, Move.RENEW, id="ours-even-if-old"),
        pytest.param(Record("", 1, "a", "b", 4), 100.0, 100.0, Move.TAKE, id="released"),
        # A short duration written by the holder counts, not ours.
        pytest.param(Record(OTHER, 1, "a", "b", 0), 100.0, 101.0, Move.TAKE, id="its-duration"),
    ],
)
def test_decide(record: Record | None, observed_at: float, now: float, move: Move) -> None:
    assert decide(record, identity=ME, observed_at=observed_at, now=now) is move


def test_records_written_by_each_move() -> None:
    timing = Timing(lease_duration=15.5, renew_deadline=10, retry_period=2)
    stamp = "2026-01-02T03:04:05.678901Z"
    created = next_record(Move.CREATE, None, identity=ME, timing=timing, now=NOW)
    assert created == Record(ME, 16, stamp, stamp, 0)  # whole seconds, rounded up
    taken = next_record(Move.TAKE, HELD, identity=ME, timing=timing, now=NOW)
    assert taken == Record(ME, 16, stamp, stamp, HELD.transitions + 1)
    ours = Record(ME, 16, "2026-01-01T00:00:00.000000Z", "x", 5)
    renewed = next_record(Move.RENEW, ours, identity=ME, timing=timing, now=NOW)
    assert renewed == Record(ME, 16, ours.acquire_time, stamp, 5)  # acquired when it was
    assert released(ours, NOW) == Record("", 1, stamp, stamp, 5)
    with pytest.raises(ValueError, match="no record to write for wait"):
        next_record(Move.WAIT, HELD, identity=ME, timing=timing, now=NOW)


def test_record_round_trips_through_a_lease_spec() -> None:
    lease = {"spec": HELD.spec()}
    assert Record.of(lease) == HELD
    assert Record.of({"spec": Record("", 1, "t", "t", 2).spec()}).holder == ""
    assert Record.of({}) == Record()  # a Lease someone created without a spec


@pytest.mark.parametrize(
    ("timing", "message"),
    [
        ({"lease_duration": 10, "renew_deadline": 10}, "must be longer than the renew deadline"),
        ({"renew_deadline": 2, "retry_period": 2}, "1.2 x the retry period"),
        ({"retry_period": 0}, "retry_period must be a number > 0"),
        ({"lease_duration": float("inf")}, "lease_duration must be a number > 0"),
        (
            {"lease_duration": 0.5, "renew_deadline": 0.4, "retry_period": 0.1},
            "at least 1 s",
        ),
    ],
)
def test_bad_timings_are_refused(timing: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Timing(**timing)


def test_default_timing_is_client_gos() -> None:
    assert Timing() == Timing(lease_duration=15, renew_deadline=10, retry_period=2)
