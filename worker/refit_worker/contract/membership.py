"""Who takes part in an epoch: the snapshot of the rendezvous map and the membership.

Holds :class:`Snapshot` and :func:`read_snapshot` (what the merged shards hold for an
epoch, by the reading rules of :mod:`refit_worker.contract.rendezvous`), the
coordinator's view of the live pods (:class:`LivePod`) and its pure decision
:func:`membership`: which rollout ranks are members of the epoch, written as the
``barrier`` entry (docs/failure-domains.md, "Rendezvous protocol v3").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from refit_worker.contract.entries import (
    BarrierEntry,
    Entry,
    EntryError,
    MetadataEntry,
    PreemptNotice,
    ProgressEntry,
    RolloutMember,
    decode_entry,
    meta_key,
    parse_key,
)
from refit_worker.contract.roles import Role


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the data of all shards holds for ``epoch``.

    ``meta``: entries of the epoch (a rollout rank's meta names the epoch it last joined);
    ``progress``: policy entries of the epoch, rollout entries of any epoch (a rollout
    rank's count carries across policy epochs); ``barrier`` and ``preempt``: of the epoch.
    Entries of ranks at or past the world sizes are left out (stale after a scale-down).
    """

    epoch: int
    meta: dict[tuple[Role, int], MetadataEntry] = field(default_factory=dict)
    progress: dict[tuple[Role, int], ProgressEntry] = field(default_factory=dict)
    barrier: BarrierEntry | None = None
    preempt: PreemptNotice | None = None


def read_snapshot(
    data: Mapping[str, str],
    epoch: int,
    policy_world_size: int,
    rollout_world_size: int,
    decode: Callable[[str, str], Entry] = decode_entry,
) -> Snapshot:
    """Decode ``data`` (all shards merged) into what concerns ``epoch`` (see
    :class:`Snapshot`); ``rollout_world_size`` is the desired R.

    Every protocol value is decoded, whatever its epoch or rank, so garbage is an
    EntryError even where it would be ignored.  ``decode`` may be a memoised
    :func:`decode_entry` (it is pure), for callers that decode the same map again on
    every change.
    """
    snap = Snapshot(epoch)
    barrier: BarrierEntry | None = None
    preempt: PreemptNotice | None = None
    for key in sorted(data):
        parsed = parse_key(key)
        if parsed is None:
            continue
        entry = decode(key, data[key])
        if isinstance(entry, MetadataEntry | ProgressEntry):
            world = policy_world_size if entry.role == "policy" else rollout_world_size
            if entry.rank >= world:
                continue
            if isinstance(entry, ProgressEntry) and entry.role == "rollout":
                snap.progress[("rollout", entry.rank)] = entry
                continue
        if entry.epoch != epoch:
            continue
        if isinstance(entry, MetadataEntry):
            snap.meta[(entry.role, entry.rank)] = entry
        elif isinstance(entry, ProgressEntry):
            snap.progress[(entry.role, entry.rank)] = entry
        elif isinstance(entry, BarrierEntry):
            if entry.policy_world_size != policy_world_size:
                raise EntryError(
                    key,
                    f"lists {entry.policy_world_size} policy ranks, "
                    f"the job has {policy_world_size}",
                )
            barrier = entry
        else:
            preempt = entry
    return Snapshot(epoch, snap.meta, snap.progress, barrier, preempt)


@dataclass(frozen=True, slots=True)
class LivePod:
    """The coordinator's view of the pod now holding a rank: its uid, its generation, and
    whether it runs (a pending pod cannot publish yet, so the first opening does not wait
    for it)."""

    uid: str
    generation: int = 0
    running: bool = True


def _matches(entry: MetadataEntry | ProgressEntry | None, pod: LivePod | None) -> bool:
    return (
        entry is not None
        and pod is not None
        and (entry.uid, entry.generation) == (pod.uid, pod.generation)
    )


def _policy_uids(
    snap: Snapshot, policy_world_size: int, live: Mapping[tuple[Role, int], LivePod]
) -> tuple[str, ...] | None:
    """Every policy rank's uid once all published for the epoch, else None.

    A policy entry of the epoch by another pod than the live one is an EntryError: the
    policy gang is not recreated within an epoch, so such a value is tampered with.
    """
    uids: list[str] = []
    for rank in range(policy_world_size):
        entry, pod = snap.meta.get(("policy", rank)), live.get(("policy", rank))
        if entry is None or pod is None:
            return None
        if entry.uid != pod.uid:
            raise EntryError(
                meta_key("policy", rank),
                f"written by pod uid {entry.uid!r}, but the rank's pod is {pod.uid!r}",
            )
        uids.append(entry.uid)
    return tuple(uids)


def slot_member(
    entry: MetadataEntry | None, pod: LivePod | None, progress: ProgressEntry | None = None
) -> RolloutMember | None:
    """Who holds a rollout slot, from the rank's meta of the epoch, its live pod and its
    progress: the pod, when the meta is its own, it is running and it has not reported
    ``left``.

    A pod that is not running holds no slot, whatever it published: one that reported
    ``left`` after a scale-down (its pod Succeeded, still listed until deleted) would
    otherwise be listed again by a scale back up, and the policy would send to a process
    that is gone.  Nor does one that reported ``left`` and is still exiting (its pod still
    Running for a moment): it takes no more refits, so a scale back up in that moment
    would have the policy wait on it for a whole timeout."""
    if pod is None or not pod.running or not _matches(entry, pod):
        return None
    if progress is not None and progress.state == "left" and _matches(progress, pod):
        return None
    return RolloutMember(uid=pod.uid, generation=pod.generation)


def _rollout_slots(
    snap: Snapshot, rollout_world_size: int, live: Mapping[tuple[Role, int], LivePod]
) -> tuple[RolloutMember | None, ...]:
    """One slot per rollout rank < R, by :func:`slot_member`."""
    return tuple(
        slot_member(
            snap.meta.get(("rollout", rank)),
            live.get(("rollout", rank)),
            snap.progress.get(("rollout", rank)),
        )
        for rank in range(rollout_world_size)
    )


def check_membership(
    snap: Snapshot,
    policy_world_size: int,
    live: Mapping[tuple[Role, int], LivePod],
    previous: BarrierEntry | None,
) -> None:
    """Raise the :class:`EntryError` :func:`membership` would raise for these inputs: on
    an epoch's first opening, a policy entry of the epoch written by another pod than the
    rank's live one.  A reader checks with it before anything is decided."""
    if previous is None or previous.epoch != snap.epoch:
        _policy_uids(snap, policy_world_size, live)


def membership(
    snap: Snapshot,
    policy_world_size: int,
    rollout_world_size: int,
    live: Mapping[tuple[Role, int], LivePod],
    previous: BarrierEntry | None,
) -> BarrierEntry | None:
    """The membership the coordinator should have written for the snapshot's epoch.

    ``live``: the pods now holding each rank; ``previous``: the barrier written so far
    (of any epoch).  The first opening of an epoch waits until every policy rank
    published for the epoch, and every rollout rank whose pod runs did, with at least one
    rollout member (a running pod that reported ``left`` holds it back until it exits,
    moments later); None until then.  Once open, the members are the rollout ranks whose
    meta of the epoch is the live pod's, and the result is ``previous`` itself while
    neither they nor R changed, else a rewrite with ``version`` + 1.
    """
    slots = _rollout_slots(snap, rollout_world_size, live)
    gens = _generations(slots, live, previous)
    if previous is not None and previous.epoch == snap.epoch:
        if previous.rollout == slots and previous.generations == gens:
            return previous
        return BarrierEntry(
            epoch=snap.epoch,
            version=previous.version + 1,
            policy_uids=previous.policy_uids,
            rollout=slots,
            generations=gens,
        )
    policy_uids = _policy_uids(snap, policy_world_size, live)
    if policy_uids is None or all(slot is None for slot in slots):
        return None
    for rank, slot in enumerate(slots):
        pod = live.get(("rollout", rank))
        if slot is None and pod is not None and pod.running:
            return None  # a running rank that has not published (for this epoch) yet
    return BarrierEntry(
        epoch=snap.epoch, version=1, policy_uids=policy_uids, rollout=slots, generations=gens
    )


def _generations(
    slots: tuple[RolloutMember | None, ...],
    live: Mapping[tuple[Role, int], LivePod],
    previous: BarrierEntry | None,
) -> tuple[int, ...]:
    """The generation each slot is held for: its live pod's (a replacement pending or
    starting counts), else its member's, else what ``previous`` said."""
    out = []
    for rank, slot in enumerate(slots):
        pod = live.get(("rollout", rank))
        if pod is not None:
            out.append(pod.generation)
        elif slot is not None:
            out.append(slot.generation)
        else:
            out.append(previous.generation_of(rank) if previous is not None else 0)
    return tuple(out)
