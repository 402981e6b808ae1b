"""Success, figures and connection state come from what ranks reported, never from exit
codes alone.  The pure reconcile only: pods as manifests, the rendezvous as data.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.support.reconcile_harness import GONE, NOW, RUNNING, SUCCEEDED, Harness
from tests.support.reconcile_harness import uid as _uid

from refit_operator.api.models import Phase, PodBytes, RefitJobStatus, RolloutReplica
from refit_operator.api.names import pod_name
from refit_operator.core.coordinate import PatchData
from refit_operator.core.decision import Create, Delete, Emit
from refit_worker.contract.entries import ProgressState, Verification
from refit_worker.contract.progress import ProgressLog
from refit_worker.contract.rendezvous import (
    BARRIER_KEY,
    BarrierEntry,
    MetadataEntry,
    ProgressEntry,
    RolloutMember,
    encode_entry,
    meta_key,
    progress_key,
)
from refit_worker.contract.roles import Role

SPEC: dict[str, Any] = {
    "image": "img",
    "policy": {"replicas": 1},
    "rollout": {"replicas": 2},
    "transfer": {"refits": 3},
    "failurePolicy": {"maxRestarts": 2, "backoffSeconds": 10},
}
NAMES = ["job-policy-0-e0", "job-rollout-0-g0", "job-rollout-1-g0"]
DRAINED_AFTER_SUCCESS = {
    "phase": "Succeeded",
    "conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
    ],
}
JOB = Harness(SPEC)
_pods, _run = JOB.pods, JOB.run


def _report(
    epoch: int,
    role: Role,
    rank: int,
    refits: int,
    *,
    state: ProgressState = "running",
    verification: Verification = "bit-exact",
    nbytes: int = 100,
    first: int = 0,
) -> tuple[str, str]:
    log = ProgressLog(first, verification=verification if role == "rollout" else "none")
    for refit in range(first, refits):
        log.record(refit, nbytes, 0.5)
    entry = ProgressEntry(
        epoch=epoch,
        # The uid of the rank's pod of that epoch (rollout pods at generation 0).
        uid=_uid(pod_name("job", role, rank, epoch if role == "policy" else 0), epoch),
        role=role,
        rank=rank,
        **log.fields(state),
    )
    return progress_key(role, rank), encode_entry(progress_key(role, rank), entry)


def _done_by_all(epoch: int = 0, refits: int = 3, **kw: Any) -> dict[str, str]:
    return dict(
        [
            _report(epoch, "policy", 0, refits, state="done", **kw),
            _report(epoch, "rollout", 0, refits, state="done", **kw),
            _report(epoch, "rollout", 1, refits, state="done", **kw),
        ]
    )


def test_success_needs_every_refit_reported_and_every_pod_exited_0() -> None:
    running = RefitJobStatus(phase=Phase.RUNNING, created_epoch=0)
    done = _run(running, _pods(0, **dict.fromkeys(NAMES, SUCCEEDED)), _done_by_all())
    s = done.status
    assert s.phase is Phase.SUCCEEDED and s.completion_time == NOW
    assert (s.refits_completed, s.bytes_transferred, s.verification) == (3, 600, "bit-exact")
    assert s.restarts == 0


def test_pods_that_exit_0_without_reporting_refits_are_a_failure() -> None:
    """``command: [/bin/true]``: every pod exits 0 and nothing moved."""
    running = RefitJobStatus(phase=Phase.RUNNING, created_epoch=0)
    d = _run(running, _pods(0, **dict.fromkeys(NAMES, SUCCEEDED)))
    assert d.status.phase is Phase.RESTARTING and d.status.restarts == 1
    assert "reported 0 of 3 refits committed" in d.status.message
    assert d.status.refits_completed == 0 and d.status.verification == "none"
    # maxRestarts later, the job fails for that reason, and never claims a refit.
    spent = running.model_copy(update={"restarts": 2})
    final = _run(spent, _pods(0, **dict.fromkeys(NAMES, SUCCEEDED)))
    assert final.status.phase is Phase.FAILED
    assert "reported 0 of 3 refits committed" in final.status.message
    assert final.status.message.endswith("maxRestarts (2) used up")


def test_too_few_refits_reported_is_not_success() -> None:
    running = RefitJobStatus(phase=Phase.RUNNING, created_epoch=0)
    d = _run(running, _pods(0, **dict.fromkeys(NAMES, SUCCEEDED)), _done_by_all(refits=2))
    assert d.status.phase is Phase.RESTARTING
    assert "reported 2 of 3 refits committed" in d.status.message
    assert d.status.refits_completed == 2  # what did happen still counts


def test_a_policy_that_fails_after_the_rollouts_finished_is_no_success() -> None:
    pods = _pods(
        0,
        **{
            "job-policy-0-e0": {"phase": "Failed", "containerStatuses": []},
            "job-rollout-0-g0": SUCCEEDED,
            "job-rollout-1-g0": SUCCEEDED,
        },
    )
    data = _done_by_all()
    data.update([_report(0, "policy", 0, 3, state="failed")])
    d = _run(RefitJobStatus(phase=Phase.RUNNING, created_epoch=0), pods, data)
    assert d.status.phase is Phase.RESTARTING and d.status.restarts == 1
    assert "job-policy-0-e0 failed" in d.status.message


def test_rollouts_done_while_the_policy_still_runs_is_not_yet_success() -> None:
    pods = _pods(
        0,
        **{
            "job-policy-0-e0": RUNNING,
            "job-rollout-0-g0": SUCCEEDED,
            "job-rollout-1-g0": SUCCEEDED,
        },
    )
    data = dict(
        [_report(0, "rollout", 0, 3, state="done"), _report(0, "rollout", 1, 3, state="done")]
    )
    d = _run(RefitJobStatus(phase=Phase.RUNNING, created_epoch=0), pods, data)
    assert d.status.phase is not Phase.SUCCEEDED and d.status.completion_time is None
    assert d.status.refits_completed == 3


def test_a_finished_pod_that_is_drained_or_gone_triggers_no_new_gang() -> None:
    # The status records the rollout pods created (as every round that created them does).
    slots = [RolloutReplica(rank=r, pod=f"job-rollout-{r}-g0") for r in (0, 1)]
    running = RefitJobStatus(phase=Phase.RUNNING, created_epoch=0, rollout_replicas=slots)
    data = dict([_report(0, "rollout", 0, 3, state="done"), _report(0, "rollout", 1, 1)])
    for rollout0 in (DRAINED_AFTER_SUCCESS, GONE):
        pods = _pods(
            0,
            **{
                "job-policy-0-e0": RUNNING,
                "job-rollout-0-g0": rollout0,
                "job-rollout-1-g0": RUNNING,
            },
        )
        d = _run(running, pods, data)
        assert (d.status.epoch, d.status.preemptions, d.status.restarts) == (0, 0, 0), rollout0
        assert d.status.phase is not Phase.RESTARTING
    # ... and once the others finish, the job succeeds with the gone pod's report.
    pods = _pods(
        0, **{"job-policy-0-e0": SUCCEEDED, "job-rollout-0-g0": GONE, "job-rollout-1-g0": SUCCEEDED}
    )
    assert _run(running, pods, _done_by_all()).status.phase is Phase.SUCCEEDED


def test_draining_a_pod_whose_rank_reported_done_is_no_preemption() -> None:
    """Its process is still exiting, but its work is on record."""
    draining = {
        **RUNNING,
        "conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"},
        ],
    }
    pods = _pods(
        0, **{"job-policy-0-e0": RUNNING, "job-rollout-0-g0": draining, "job-rollout-1-g0": RUNNING}
    )
    running = RefitJobStatus(phase=Phase.RUNNING, created_epoch=0)
    done_first = dict([_report(0, "rollout", 0, 3, state="done"), _report(0, "rollout", 1, 2)])
    kept = _run(running, pods, done_first).status
    assert (kept.preemptions, kept.rollout.replacements) == (0, 0)
    # Not done yet: the rollout replica is replaced alone, the policy pod untouched.
    not_done = dict([_report(0, "rollout", 0, 2), _report(0, "rollout", 1, 2)])
    d = _run(running, pods, not_done)
    assert (d.status.preemptions, d.status.rollout.replacements, d.status.epoch) == (0, 1, 0)
    assert [a.name for a in d.actions if isinstance(a, Delete)] == ["job-rollout-0-g0"]


def test_a_running_pod_that_goes_missing_is_still_a_preemption() -> None:
    slots = [RolloutReplica(rank=r, pod=f"job-rollout-{r}-g0") for r in (0, 1)]
    running = RefitJobStatus(phase=Phase.RUNNING, created_epoch=0, rollout_replicas=slots)
    pods = _pods(
        0, **{"job-policy-0-e0": RUNNING, "job-rollout-0-g0": GONE, "job-rollout-1-g0": RUNNING}
    )
    d = _run(running, pods, dict([_report(0, "rollout", 0, 1)]))
    # A rollout replica: replaced alone (a preemption of the replica, not of the gang).
    assert (d.status.preemptions, d.status.rollout.replacements) == (0, 1)
    (event,) = [a for a in d.actions if isinstance(a, Emit) and a.reason == "RolloutReplaced"]
    assert event.type == "Normal" and "job-rollout-0-g0: PodMissing" in event.message
    assert [a.obj["metadata"]["name"] for a in d.actions if isinstance(a, Create)] == [
        "job-rollout-0-g1"
    ]


@pytest.mark.parametrize(
    ("methods", "shown"),
    [
        (("bit-exact", "bit-exact"), "bit-exact"),
        (("bit-exact", "checksums"), "checksums"),
        (("checksums", "manifest"), "manifest"),
        (("manifest", "none"), "none"),
    ],
)
def test_status_shows_the_weakest_verification_any_rank_reported(
    methods: tuple[Verification, Verification], shown: str
) -> None:
    data = dict(
        [
            _report(0, "rollout", 0, 1, verification=methods[0]),
            _report(0, "rollout", 1, 1, verification=methods[1]),
        ]
    )
    pods = _pods(0, **dict.fromkeys(NAMES, RUNNING))
    d = _run(RefitJobStatus(phase=Phase.RUNNING, created_epoch=0), pods, data)
    assert d.status.verification == shown


def _published(epoch: int, names: list[str]) -> dict[str, str]:
    out = {}
    for name in names:
        role, rank = name.split("-")[1], int(name.split("-")[2])
        key = meta_key(role, rank)  # type: ignore[arg-type]
        entry = MetadataEntry(
            epoch=epoch, uid=_uid(name, epoch), role=role, rank=rank, agent='{"a": 1}'
        )
        out[key] = encode_entry(key, entry)
    return out


def test_connected_says_how_many_ranks_published_until_the_barrier_opens() -> None:
    running = RefitJobStatus(phase=Phase.RUNNING, created_epoch=0)
    pods = _pods(0, **dict.fromkeys(NAMES, RUNNING))
    partial = _run(running, pods, _published(0, NAMES[:2]))
    connected = next(c for c in partial.status.conditions if c.type == "Connected")
    assert (connected.status, connected.reason) == ("False", "WaitingForRanks")
    assert connected.message == "2 of 3 ranks published"
    full = _run(running, pods, _published(0, NAMES))
    connected = next(c for c in full.status.conditions if c.type == "Connected")
    assert (connected.status, connected.reason) == ("True", "BarrierOpen")


def test_a_forged_barrier_is_removed_until_every_rank_published() -> None:
    running = RefitJobStatus(phase=Phase.RUNNING, created_epoch=0)
    pods = _pods(0, **dict.fromkeys(NAMES, RUNNING))
    forged = BarrierEntry(
        epoch=0, policy_uids=("x",), rollout=(RolloutMember(uid="y"), RolloutMember(uid="z"))
    )
    data = {**_published(0, NAMES[:1]), BARRIER_KEY: encode_entry(BARRIER_KEY, forged)}
    d = _run(running, pods, data)
    (patch,) = [a for a in d.actions if isinstance(a, PatchData)]
    assert patch.data == {BARRIER_KEY: None}
    flag = next(c for c in d.status.conditions if c.type == "RendezvousReadable")
    assert "did not write; removed" in flag.message


def test_reports_that_land_after_a_restart_are_still_counted() -> None:
    """The stopped gang's last report can arrive after the restart decision."""
    uids = [_uid(pod_name("job", "rollout", rank, 0), 0) for rank in (0, 1)]
    restarting = RefitJobStatus(
        phase=Phase.RESTARTING,
        epoch=1,
        refits_completed=1,
        bytes_transferred=200,
        bytes_counted=[PodBytes(uid=uid, bytes=100) for uid in uids],
    )
    late = dict([_report(0, "rollout", 0, 2), _report(0, "rollout", 1, 2)])
    d = _run(restarting, [], late)
    assert (d.status.bytes_transferred, d.status.refits_completed) == (400, 2)
    assert d.status.bytes_counted == [PodBytes(uid=uid, bytes=200) for uid in uids]
    again = _run(d.status, [], late)  # read twice, counted once
    assert again.status.bytes_transferred == 400
    cleared = _run(again.status, [], {})  # the old epoch's entries cleared: still counted
    assert cleared.status.bytes_transferred == 400


def test_a_lost_status_write_does_not_wipe_what_the_live_gang_published() -> None:
    """The round that created the gang could not write its status (409): the next round
    sees this epoch's pods and must adopt them, not clear the rendezvous again."""
    lost = RefitJobStatus(phase=Phase.PENDING, epoch=0, created_epoch=None)
    pods = _pods(0, **dict.fromkeys(NAMES, RUNNING))
    d = _run(lost, pods, _published(0, NAMES[:2]))
    patches = [a for a in d.actions if isinstance(a, PatchData)]
    assert all(None not in p.data.values() for p in patches), patches  # nothing deleted
    assert not [a for a in d.actions if isinstance(a, Create)]
    assert d.status.created_epoch == 0
    connected = next(c for c in d.status.conditions if c.type == "Connected")
    assert connected.message == "2 of 3 ranks published"


def test_a_lost_write_after_a_partly_created_gang_creates_the_rest() -> None:
    """The creating round's parallel POSTs half failed, so its status was never written:
    the ranks not yet created are created into the same epoch, not counted as lost."""
    lost = RefitJobStatus(phase=Phase.PENDING, epoch=0, created_epoch=None)
    pods = _pods(0, **{NAMES[0]: RUNNING, NAMES[1]: GONE, NAMES[2]: GONE})
    d = _run(lost, pods, _published(0, NAMES[:1]))
    created = sorted(a.obj["metadata"]["name"] for a in d.actions if isinstance(a, Create))
    assert created == NAMES[1:]
    assert all(
        a.obj["metadata"]["labels"]["refit.dev/epoch"] == "0"
        for a in d.actions
        if isinstance(a, Create)
    )
    assert not [a for a in d.actions if isinstance(a, Delete)]
    assert (d.status.epoch, d.status.restarts, d.status.preemptions) == (0, 0, 0)
    assert d.status.created_epoch == 0


def test_a_rollout_rank_gone_after_the_barrier_opened_comes_back_alone() -> None:
    """The status write was lost, the barrier opened, then a rollout pod went: nothing
    records it as created, so its slot gets a pod; the policy pod is untouched."""
    lost = RefitJobStatus(phase=Phase.RUNNING, epoch=0, created_epoch=None)
    pods = _pods(0, **{NAMES[0]: RUNNING, NAMES[1]: RUNNING, NAMES[2]: GONE})
    barrier = BarrierEntry(
        epoch=0,
        policy_uids=(_uid(NAMES[0], 0),),
        rollout=(RolloutMember(uid=_uid(NAMES[1], 0)), RolloutMember(uid=_uid(NAMES[2], 0))),
    )
    data = {**_published(0, NAMES), BARRIER_KEY: encode_entry(BARRIER_KEY, barrier)}
    d = _run(lost, pods, data)
    created = [a.obj["metadata"]["name"] for a in d.actions if isinstance(a, Create)]
    assert created == [NAMES[2]]
    assert not [a for a in d.actions if isinstance(a, Delete)]
    assert (d.status.epoch, d.status.preemptions, d.status.restarts) == (0, 0, 0)
