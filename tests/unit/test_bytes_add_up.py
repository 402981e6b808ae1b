"""Issue #30: one byte figure, what the rollout pods reported receiving, counted once per
pod over every pod the job ever had, so it never goes down.

Pure: :func:`count_bytes` on progress entries as data, and the reconcile (its own
``count_bytes`` step) on pods and rendezvous as data.  Nothing is emulated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from tests.support.reconcile_harness import RUNNING, SUCCEEDED, Harness

from refit_operator.api.models import Phase, PodBytes, RefitJobStatus
from refit_operator.core.progress import bytes_received, count_bytes
from refit_worker.contract.rendezvous import ProgressEntry, encode_entry, progress_key
from refit_worker.contract.roles import Role


def _entry(uid: str, nbytes: int, *, rank: int = 0, epoch: int = 0, role: Role = "rollout") -> Any:
    return ProgressEntry(epoch=epoch, uid=uid, role=role, rank=rank, bytes_total=nbytes)


def _count(*rounds: Sequence[ProgressEntry]) -> list[PodBytes]:
    """What the status holds after one round per element of ``rounds``."""
    counted: list[PodBytes] = []
    for entries in rounds:
        counted = count_bytes(entries, counted)
    return counted


def test_a_scale_down_keeps_the_left_pods_bytes() -> None:
    # Two pods serve; rank 1 leaves at the scale-down and its entry is cleared.
    counted = _count([_entry("a", 100), _entry("b", 100, rank=1)], [_entry("a", 200)])
    assert counted == [PodBytes(uid="a", bytes=200), PodBytes(uid="b", bytes=100)]
    assert bytes_received(counted) == 300


def test_a_replacement_adds_the_new_pods_bytes_to_the_old_ones() -> None:
    # The replacement's report takes the old pod's key: the old bytes stay counted.
    assert bytes_received(_count([_entry("old", 200)], [_entry("new", 50)])) == 250


def test_a_pod_that_outlives_a_policy_restart_is_counted_once() -> None:
    """A rollout pod's totals carry on across policy epochs: 250 is all it received,
    not 100 + 250 (the old ``bytesBeforeEpoch`` sum counted it once per epoch)."""
    counted = _count([_entry("a", 100, epoch=0)], [], [_entry("a", 250, epoch=1)])
    assert bytes_received(counted) == 250


def test_a_pod_seen_twice_counts_once() -> None:
    # Read twice, and under two keys at once (a stale copy beside the new one).
    twice = [_entry("a", 100), _entry("a", 100, rank=1)]
    assert bytes_received(_count(twice, twice)) == 100


def test_an_older_report_read_late_does_not_lower_a_pods_count() -> None:
    assert _count([_entry("a", 300)], [_entry("a", 100)]) == [PodBytes(uid="a", bytes=300)]


def test_policy_reports_are_what_they_sent_not_counted() -> None:
    assert _count([_entry("p", 999, role="policy"), _entry("a", 10)]) == [
        PodBytes(uid="a", bytes=10)
    ]


@pytest.mark.parametrize(
    "rounds",
    [
        # A replacement, its late report, a scale-down, the map cleared by a restart.
        [["a:10", "b:10"], ["a:20", "b:20"], ["c:5", "b:20"], ["c:15"], [], ["d:1", "c:15"]],
        # Reports read out of order and dropping in and out.
        [["a:30"], ["a:10"], [], ["b:5"], ["a:20", "b:1"]],
    ],
)
def test_the_figure_never_goes_down(rounds: list[list[str]]) -> None:
    counted: list[PodBytes] = []
    seen: list[int] = []
    for entries in rounds:
        parsed = [_entry(uid, int(n)) for uid, n in (e.split(":") for e in entries)]
        counted = count_bytes(parsed, counted)
        seen.append(bytes_received(counted))
    assert seen == sorted(seen)
    # And it is the sum of each pod's most.
    most: dict[str, int] = {}
    for entries in rounds:
        for uid, n in (e.split(":") for e in entries):
            most[uid] = max(most.get(uid, 0), int(n))
    assert seen[-1] == sum(most.values())


SPEC: dict[str, Any] = {"image": "img", "policy": {"replicas": 1}, "rollout": {"replicas": 1}}
JOB = Harness(SPEC)


def _data(uid: str, nbytes: int) -> dict[str, str]:
    key = progress_key("rollout", 0)
    return {key: encode_entry(key, _entry(uid, nbytes))}


def test_the_reconcile_counts_a_finished_jobs_late_report_too() -> None:
    """The count runs first in every round: a report that lands after the job succeeded
    still reaches ``bytesTransferred`` (the summary's rows would otherwise disagree)."""
    done = RefitJobStatus(
        phase=Phase.SUCCEEDED,
        created_epoch=0,
        bytes_counted=[PodBytes(uid="uid-job-rollout-0-g0-0", bytes=100)],
        bytes_transferred=100,
    )
    pods = JOB.pods(0, **{"job-policy-0-e0": SUCCEEDED, "job-rollout-0-g0": SUCCEEDED})
    d = JOB.run(done, pods, _data("uid-job-rollout-0-g0-0", 300))
    assert (d.status.phase, d.status.bytes_transferred) == (Phase.SUCCEEDED, 300)


def test_the_reconcile_keeps_a_replaced_pods_bytes_after_its_report_is_gone() -> None:
    running = RefitJobStatus(phase=Phase.RUNNING, created_epoch=0)
    pods = JOB.pods(0, **{"job-policy-0-e0": RUNNING, "job-rollout-0-g0": RUNNING})
    first = JOB.run(running, pods, _data("uid-job-rollout-0-g0-0", 400))
    assert first.status.bytes_transferred == 400
    taken = JOB.run(first.status, pods, _data("uid-other-pod", 40))
    assert taken.status.bytes_transferred == 440
    cleared = JOB.run(taken.status, pods, {})
    assert cleared.status.bytes_transferred == 440
    assert [c.uid for c in cleared.status.bytes_counted] == [
        "uid-job-rollout-0-g0-0",
        "uid-other-pod",
    ]


def test_a_job_counted_by_an_older_operator_keeps_its_figure() -> None:
    """Upgraded mid-job: ``bytesTransferred`` was counted without ``bytesCounted``; the
    figure (a Prometheus counter) does not drop to what the pods now show."""
    older = RefitJobStatus(phase=Phase.RUNNING, created_epoch=0, bytes_transferred=1000)
    pods = JOB.pods(0, **{"job-policy-0-e0": RUNNING, "job-rollout-0-g0": RUNNING})
    d = JOB.run(older, pods, _data("uid-job-rollout-0-g0-0", 300))
    assert d.status.bytes_transferred == 1000
    assert d.status.bytes_counted == [PodBytes(uid="uid-job-rollout-0-g0-0", bytes=300)]
    passed = JOB.run(d.status, pods, _data("uid-job-rollout-0-g0-0", 1200))
    assert passed.status.bytes_transferred == 1200
