"""The Event recorder's decisions (``refit_operator.shell.events``): which occurrence creates an
Event and which updates a series, for both Event APIs.  Pure: the clock is given.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from refit_operator.shell.events import (
    CORE_V1,
    EVENTS_V1,
    SERIES_WINDOW_S,
    EventKey,
    EventRecorder,
    NewEvent,
    Repeat,
)

JOB = {
    "apiVersion": "refit.dev/v1alpha1",
    "kind": "RefitJob",
    "metadata": {"name": "demo", "namespace": "team-a", "uid": "u-1"},
}
T0 = datetime(2026, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _recorder(clock: Clock, **kw: int) -> EventRecorder:
    return EventRecorder(controller="refit.dev/refit-operator", instance="op-0", clock=clock, **kw)


def _post(
    rec: EventRecorder, key: EventKey, now: datetime, api: str = EVENTS_V1
) -> NewEvent | Repeat:
    """One occurrence, as ``kube.post_event`` does it; returns what was posted."""
    step = rec.repeat(key, now)
    if step is not None:
        rec.posted(key, step)
        return step
    new = rec.new(key, now, api)
    rec.posted(key, new, new.body["metadata"]["name"])
    return new


def test_first_occurrence_is_an_events_v1_event_about_the_job() -> None:
    rec = _recorder(Clock())
    key = EventKey.about(JOB, "Warning", "Preempted", "gang preempted (1): node drained")
    assert rec.repeat(key, T0) is None
    body = rec.new(key, T0, EVENTS_V1).body
    assert body["apiVersion"] == "events.k8s.io/v1"
    assert body["regarding"] == {
        "apiVersion": "refit.dev/v1alpha1",
        "kind": "RefitJob",
        "name": "demo",
        "namespace": "team-a",
        "uid": "u-1",
    }
    assert body["metadata"]["namespace"] == "team-a"
    assert body["metadata"]["name"].startswith("demo.")
    assert body["eventTime"] == "2026-05-06T07:08:09.123456Z"
    assert (body["reportingController"], body["reportingInstance"]) == (
        "refit.dev/refit-operator",
        "op-0",
    )
    assert (body["type"], body["reason"], body["action"], body["note"]) == (
        "Warning",
        "Preempted",
        "Reconcile",
        "gang preempted (1): node drained",
    )
    assert "series" not in body


@pytest.mark.parametrize(
    ("api", "patch"),
    [
        (EVENTS_V1, {"series": {"count": 3, "lastObservedTime": "2026-05-06T07:08:29.123456Z"}}),
        (CORE_V1, {"count": 3, "lastTimestamp": "2026-05-06T07:08:29Z"}),
    ],
)
def test_repeats_update_one_series(api: str, patch: dict[str, object]) -> None:
    clock = Clock()
    rec = _recorder(clock)
    key = EventKey.about(JOB, "Normal", "Running", "phase Pending -> Running")
    first = _post(rec, key, T0, api)
    assert isinstance(first, NewEvent) and first.api_version == api
    clock.now += 10
    second = _post(rec, key, T0 + timedelta(seconds=10), api)
    clock.now += 10
    third = _post(rec, key, T0 + timedelta(seconds=20), api)
    assert isinstance(second, Repeat) and isinstance(third, Repeat)
    assert second.name == third.name == first.body["metadata"]["name"]
    assert (second.count, third.count) == (2, 3)
    assert third.patch == patch


def test_another_message_or_object_is_another_event() -> None:
    rec = _recorder(Clock())
    key = EventKey.about(JOB, "Warning", "Preempted", "gang preempted (1): a")
    _post(rec, key, T0)
    other_note = EventKey.about(JOB, "Warning", "Preempted", "gang preempted (2): b")
    assert rec.repeat(other_note, T0) is None
    other_job = {**JOB, "metadata": {**JOB["metadata"], "uid": "u-2"}}
    assert rec.repeat(EventKey.about(other_job, "Warning", "Preempted", key.note), T0) is None


def test_after_the_window_or_an_expiry_a_new_event_starts() -> None:
    clock = Clock()
    rec = _recorder(clock)
    key = EventKey.about(JOB, "Warning", "Failed", "exit code 1")
    first = _post(rec, key, T0)
    clock.now += SERIES_WINDOW_S + 1
    assert rec.repeat(key, T0) is None  # too long ago: a new Event
    second = _post(rec, key, T0 + timedelta(minutes=7))
    assert isinstance(first, NewEvent) and isinstance(second, NewEvent)
    assert second.body["metadata"]["name"] != first.body["metadata"]["name"]
    rec.forget(key)  # the API said 404: expired
    assert rec.repeat(key, T0) is None


def test_event_names_never_repeat_within_one_instant() -> None:
    rec = _recorder(Clock())
    names = {
        rec.new(EventKey.about(JOB, "Normal", "R", str(i)), T0, EVENTS_V1).body["metadata"]["name"]
        for i in range(5)
    }
    assert len(names) == 5


def test_memory_is_bounded_least_recently_seen_first() -> None:
    rec = _recorder(Clock(), max_remembered=2)
    keys = [EventKey.about(JOB, "Normal", "R", note) for note in "abc"]
    for key in keys:
        _post(rec, key, T0)
    assert rec.repeat(keys[0], T0) is None  # forgotten
    assert rec.repeat(keys[2], T0) is not None


def test_long_notes_are_cut_to_what_the_api_accepts() -> None:
    key = EventKey.about(JOB, "Warning", "Failed", "x" * 5000)
    assert len(key.note) == 1024
