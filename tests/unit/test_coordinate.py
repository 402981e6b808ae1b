"""Unit tests of the operator's rendezvous coordination: the membership it writes.

Pure: :func:`~refit_operator.core.coordinate.read_rendezvous`, then :func:`decide_barrier`,
over a rendezvous map given as data, the live pods given as :class:`LivePod`; nothing runs.
"""

from __future__ import annotations

import json

from tests.support.rendezvous_maps import spread

from refit_operator.core.coordinate import (
    Coordination,
    PatchData,
    decide_barrier,
    decode,
    preempt_notice,
    progress_of,
    read_rendezvous,
)
from refit_worker.contract.rendezvous import (
    BARRIER_KEY,
    PREEMPT_KEY,
    BarrierEntry,
    LivePod,
    MetadataEntry,
    ProgressEntry,
    RolloutMember,
    decode_entry,
    encode_entry,
    meta_key,
    progress_key,
)
from refit_worker.contract.roles import Role

MAP = "job-rendezvous"


def _meta(role: Role, rank: int, epoch: int = 0, generation: int = 0) -> tuple[str, str]:
    key = meta_key(role, rank)
    entry = MetadataEntry(
        epoch=epoch,
        uid=f"{role}-{rank}-g{generation}",
        role=role,
        rank=rank,
        generation=generation,
        agent="{}",
    )
    return key, encode_entry(key, entry)


def _pod(role: Role, rank: int, generation: int = 0, running: bool = True) -> LivePod:
    return LivePod(f"{role}-{rank}-g{generation}", generation, running)


def _live(rollout: int = 2) -> dict[tuple[Role, int], LivePod]:
    pods: dict[tuple[Role, int], LivePod] = {("policy", 0): _pod("policy", 0)}
    pods.update({("rollout", r): _pod("rollout", r) for r in range(rollout)})
    return pods


def _data(rollout: int = 2, epoch: int = 0) -> dict[str, str]:
    return dict([_meta("policy", 0, epoch), *(_meta("rollout", r, epoch) for r in range(rollout))])


def _written(patches: tuple[PatchData, ...]) -> BarrierEntry | None:
    (patch,) = patches
    assert patch.name == MAP
    value = patch.data[BARRIER_KEY]
    if value is None:
        return None
    entry = decode_entry(BARRIER_KEY, value)
    assert isinstance(entry, BarrierEntry)
    return entry


def _round(
    data: dict[str, str],
    live: dict[tuple[Role, int], LivePod],
    world: tuple[int, int] = (1, 2),
    **options: bool,
) -> Coordination:
    read = read_rendezvous(
        "job", decode(spread("job", data)), epoch=0, world=world, live=live, **options
    )
    return decide_barrier(read)


def test_whole_gang_first_opening_waits_for_every_rollout_slot() -> None:
    live = _live() | {("rollout", 1): _pod("rollout", 1, running=False)}
    data = _data(rollout=1)  # rollout rank 1 is pending: it has not published
    waiting = _round(data, live)
    assert (waiting.patches, waiting.barrier_open, waiting.published) == ((), False, 2)
    # Per-role failure domains do not wait for a pod that is not running yet.
    opened = _written(_round(data, live, whole_gang=False).patches)
    assert opened is not None and opened.rollout == (RolloutMember(uid="rollout-0-g0"), None)


def test_the_membership_is_rewritten_one_version_on_as_pods_come_and_go() -> None:
    data = _data()
    first = _written(_round(data, _live()).patches)
    assert first is not None and first.version == 1 and first.members() == (0, 1)
    data[BARRIER_KEY] = encode_entry(BARRIER_KEY, first)
    unchanged = _round(data, _live())
    assert (unchanged.patches, unchanged.barrier_open, unchanged.problem) == ((), True, None)
    # Rollout rank 1 is lost: the slot empties (version 2), no problem is reported.
    lost = _round(data, _live(rollout=1))
    assert lost.problem is None and lost.barrier_open
    second = _written(lost.patches)
    assert second is not None and (second.version, second.members()) == (2, (0,))
    data[BARRIER_KEY] = encode_entry(BARRIER_KEY, second)
    # Its replacement, generation 1, publishes: it joins (version 3).
    data.update([_meta("rollout", 1, generation=1)])
    live = _live() | {("rollout", 1): _pod("rollout", 1, generation=1)}
    third = _written(_round(data, live).patches)
    assert third is not None and third.version == 3
    assert third.rollout[1] == RolloutMember(uid="rollout-1-g1", generation=1)
    # Scaled to 3 rollout replicas: a slot more, empty until the new rank publishes.
    data[BARRIER_KEY] = encode_entry(BARRIER_KEY, third)
    fourth = _written(_round(data, live, world=(1, 3)).patches)
    assert fourth is not None and (fourth.version, fourth.rollout_world_size) == (4, 3)


def test_a_forged_barrier_is_replaced_a_version_on_and_reported() -> None:
    data = _data()
    forged = BarrierEntry(
        epoch=0, version=7, policy_uids=("intruder",), rollout=(RolloutMember(uid="x"),)
    )
    data[BARRIER_KEY] = encode_entry(BARRIER_KEY, forged)
    result = _round(data, _live())
    assert result.problem is not None and "did not write; rewritten" in result.problem
    fixed = _written(result.patches)
    assert fixed is not None and fixed.version == 8 and fixed.policy_uids == ("policy-0-g0",)


def test_reading_decides_nothing_and_a_policy_entry_by_another_pod_is_named_there() -> None:
    # The round reads the rendezvous (observation); the barrier is decided by a step from
    # that read, so reading a map that needs a barrier yields none of its patches.
    read = read_rendezvous(
        "job", decode(spread("job", _data())), epoch=0, world=(1, 2), live=_live()
    )
    assert read.problem is None and read.stored is None and read.progress is not None
    assert not hasattr(read, "patches")
    opened = _written(decide_barrier(read).patches)
    assert opened is not None and opened.members() == (0, 1)
    # A policy entry of the epoch written by another pod than the live one: the read names
    # it (no progress is read), and the decision writes nothing.
    live = _live() | {("policy", 0): LivePod("someone-else", 0, True)}
    tampered = read_rendezvous(
        "job", decode(spread("job", _data())), epoch=0, world=(1, 2), live=live
    )
    assert tampered.problem is not None and "written by pod uid" in tampered.problem
    assert tampered.progress is None
    assert decide_barrier(tampered).patches == ()


def test_a_barrier_of_an_earlier_epoch_is_no_previous() -> None:
    data = _data(epoch=1)
    old = BarrierEntry(epoch=0, version=5, policy_uids=("p",), rollout=(RolloutMember(uid="r"),))
    data[BARRIER_KEY] = encode_entry(BARRIER_KEY, old)
    read = read_rendezvous(
        "job", decode(spread("job", data)), epoch=1, world=(1, 2), live=_live(), whole_gang=True
    )
    result = decide_barrier(read)
    new = _written(result.patches)
    assert result.problem is None and new is not None and (new.epoch, new.version) == (1, 1)


def test_preempt_notice_names_the_role_it_stops() -> None:
    patch = preempt_notice(
        "job", epoch=2, pod="job-policy-0", uid="u", reason="drain", role="policy"
    )
    assert patch is not None and patch.name == MAP
    assert json.loads(str(patch.data[PREEMPT_KEY]))["role"] == "policy"
    everyone = preempt_notice("job", epoch=2, pod="job-rollout-0", uid="u", reason="x" * 300)
    assert everyone is not None
    notice = json.loads(str(everyone.data[PREEMPT_KEY]))
    assert notice["role"] is None and len(notice["reason"]) == 200


def test_progress_of_an_epoch_leaves_out_later_reports_under_the_same_key() -> None:
    def report(epoch: int, nbytes: int) -> tuple[str, str]:
        key = progress_key("rollout", 0)
        entry = ProgressEntry(epoch=epoch, uid="r", role="rollout", rank=0, bytes_total=nbytes)
        return key, encode_entry(key, entry)

    decoded = decode(spread("job", dict([report(1, 500)])))
    old = progress_of(decoded, epoch=0, world=(1, 1))
    assert old is not None and old.bytes_total == 0
    now = progress_of(decoded, epoch=1, world=(1, 1))
    assert now is not None and now.bytes_total == 500
