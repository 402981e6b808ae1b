"""The operator's side of the rendezvous protocol: write the membership (``barrier``),
read progress, post the preemption notice.  Decisions come from
``refit_worker.contract.rendezvous`` (:func:`membership`, shared with the local runner);
this module turns them into ConfigMap patches: :func:`read_rendezvous` is the round's
observation (read and checked, nothing decided), :func:`decide_barrier` the step's decision.

The operator never writes a rank's own keys; it writes only ``barrier`` and ``preempt``
(both in its own map, ``<job>-rendezvous``, which workers may only read), and clears the
maps between epochs.  The map is decoded once per round
(:func:`decode`, kept in ``Observed.entries``); the barrier, progress and the operator's
metrics all read that one decoding.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from refit_operator.api import names
from refit_worker.contract.rendezvous import (
    BARRIER_KEY,
    PREEMPT_KEY,
    BarrierEntry,
    Entry,
    EntryError,
    LivePod,
    MetadataEntry,
    ProgressEntry,
    ProgressSummary,
    Snapshot,
    aggregate_progress,
    at_home,
    check_membership,
    decode_entry,
    encode_entry,
    make_preempt_notice,
    membership,
    parse_key,
    place_of_name,
    read_snapshot,
)
from refit_worker.contract.roles import Role


@dataclass(frozen=True)
class PatchData:
    """A JSON merge patch of one ConfigMap's ``data`` (a None value deletes the key)."""

    name: str
    data: Mapping[str, str | None]


@dataclass(frozen=True)
class Coordination:
    patches: tuple[PatchData, ...] = ()
    progress: ProgressSummary | None = None
    #: Why the rendezvous cannot be read (a bad entry, named by key); None when fine.
    problem: str | None = None
    #: Ranks of the epoch that published their metadata, and whether the barrier is open
    #: (or opens with these patches): the ranks are connecting until it is.
    published: int = 0
    barrier_open: bool = False


def merged(rendezvous: Mapping[str, Mapping[str, str]] | None) -> dict[str, str]:
    """All maps' data in one, each key taken only from the map it belongs in (its name
    says which): a barrier in a role's map, or one role's entry in the other's, was
    written by a pod the map's rights do not speak for, and is not read."""
    out: dict[str, str] = {}
    for name, data in sorted((rendezvous or {}).items()):
        place = place_of_name(name)
        if place is not None:
            out.update(at_home(place, data))
    return out


@dataclass(frozen=True)
class Decoded:
    """Every protocol entry of a job's rendezvous map, decoded once: key -> the entry, or
    the :class:`EntryError` that says why it does not decode."""

    data: Mapping[str, str]
    entries: Mapping[str, Entry | EntryError]

    def entry(self, key: str, value: str) -> Entry:
        """The decoding of ``key`` (a ``decode`` for ``read_snapshot``); raises its error."""
        found = self.entries.get(key)
        if found is None or self.data.get(key) != value:
            return decode_entry(key, value)
        if isinstance(found, EntryError):
            raise found
        return found

    def progress(self) -> Iterator[ProgressEntry]:
        """Every rank's progress entry that decodes, of any epoch."""
        for found in self.entries.values():
            if isinstance(found, ProgressEntry):
                yield found


def decode(rendezvous: Mapping[str, Mapping[str, str]] | None) -> Decoded:
    data = merged(rendezvous)
    entries: dict[str, Entry | EntryError] = {}
    for key, value in data.items():
        if parse_key(key) is None:
            continue
        try:
            entries[key] = decode_entry(key, value)
        except EntryError as exc:
            entries[key] = exc
    return Decoded(data, entries)


@dataclass(frozen=True)
class RendezvousRead:
    """What the rendezvous of an epoch says, read and checked, before anything is decided
    (the round's observation): the snapshot, the barrier stored and whether it is the
    operator's own earlier one, the ranks' progress, and the pods holding each rank."""

    job: str
    epoch: int
    world: tuple[int, int]
    live: Mapping[tuple[Role, int], LivePod]
    whole_gang: bool
    snap: Snapshot | None = None
    stored: BarrierEntry | None = None
    previous: BarrierEntry | None = None
    progress: ProgressSummary | None = None
    #: Why the rendezvous cannot be read (a bad entry, named by key); None when fine.
    problem: str | None = None


def read_rendezvous(
    job: str,
    decoded: Decoded,
    *,
    epoch: int,
    world: tuple[int, int],
    live: Mapping[tuple[Role, int], LivePod],
    whole_gang: bool = True,
) -> RendezvousRead:
    """Read the rendezvous of ``epoch``: ``live``, the pods now holding each rank;
    ``whole_gang``, whether the first opening also waits for every rollout slot."""
    read = RendezvousRead(job, epoch, world, live, whole_gang)
    policy, rollout = world
    try:
        snap = read_snapshot(decoded.data, epoch, policy, rollout, decoded.entry)
        stored = _stored_barrier(decoded)
        previous = _own(snap, policy, stored)
        check_membership(snap, policy, live, previous)
        progress = aggregate_progress(snap, policy, rollout, live)
    except EntryError as exc:
        return replace(read, problem=str(exc))
    return replace(read, snap=snap, stored=stored, previous=previous, progress=progress)


def decide_barrier(read: RendezvousRead) -> Coordination:
    """Write the membership of the read epoch as :func:`membership` decides (one failure
    domain for the whole job: the first opening waits for every rollout slot when
    ``whole_gang``; later rewrites follow :func:`membership` either way)."""
    snap, stored, previous = read.snap, read.stored, read.previous
    if snap is None:
        return Coordination(problem=read.problem)
    policy, rollout = read.world
    want = membership(snap, policy, rollout, read.live, previous)
    if previous is None and want is not None and read.whole_gang and None in want.rollout:
        want = None
    shard0 = names.rendezvous_name(read.job)
    published = len(snap.meta)
    if stored is None or stored.epoch != read.epoch or previous is not None:
        patches: tuple[PatchData, ...] = ()
        if want is not None and want != stored:
            patches = (PatchData(shard0, {BARRIER_KEY: encode_entry(BARRIER_KEY, want)}),)
        return Coordination(patches, read.progress, None, published, want is not None)
    # Only the operator writes the barrier: one it would not have written is replaced by
    # the true one (a version on, so no reader takes it for older), or removed while
    # ranks are still missing.
    value = None
    if want is not None:
        value = encode_entry(BARRIER_KEY, want.model_copy(update={"version": stored.version + 1}))
    problem = (
        f"rendezvous key {BARRIER_KEY!r}: a barrier of epoch {read.epoch} the operator did "
        f"not write; {'rewritten' if want is not None else 'removed until every rank publishes'}"
    )
    return Coordination(
        (PatchData(shard0, {BARRIER_KEY: value}),),
        read.progress,
        problem,
        published,
        want is not None,
    )


def _stored_barrier(decoded: Decoded) -> BarrierEntry | None:
    """The barrier now in the map, of any epoch; EntryError if it does not decode."""
    value = decoded.data.get(BARRIER_KEY)
    if value is None:
        return None
    entry = decoded.entry(BARRIER_KEY, value)
    return entry if isinstance(entry, BarrierEntry) else None


def _own(snap: Snapshot, policy: int, stored: BarrierEntry | None) -> BarrierEntry | None:
    """``stored`` when it is the operator's earlier membership of the snapshot's epoch:
    the epoch's, listing the policy ranks that published for it.  (The operator keeps no
    state between rounds; a barrier it could not have written is no ``previous``.)"""
    if stored is None or stored.epoch != snap.epoch:
        return None
    uids = tuple(snap.meta[("policy", r)].uid for r in range(policy) if ("policy", r) in snap.meta)
    return stored if uids == stored.policy_uids else None


def progress_of(decoded: Decoded, *, epoch: int, world: tuple[int, int]) -> ProgressSummary | None:
    """What the ranks reported in ``epoch`` itself (a rollout report of a later epoch,
    from the same key, is not this epoch's), or None when it cannot be read."""
    try:
        snap = read_snapshot(decoded.data, epoch, *world, decoded.entry)
    except EntryError:
        return None
    own = {key: p for key, p in snap.progress.items() if p.epoch == epoch}
    return aggregate_progress(replace(snap, progress=own), *world)


def preempt_notice(
    job: str,
    *,
    epoch: int,
    pod: str,
    uid: str,
    reason: str,
    role: Literal["policy"] | None = None,
) -> PatchData | None:
    """Tell every rank of ``epoch`` (``role`` None), or only its policy gang (``role``
    "policy"), to stop at its next safe point (None: no valid uid)."""
    try:
        notice = make_preempt_notice(epoch, pod, uid, reason[:200], role=role)
    except ValueError:  # a pod without a proper uid (never from a real API server)
        return None
    value = encode_entry(PREEMPT_KEY, notice)
    return PatchData(names.rendezvous_name(job), {PREEMPT_KEY: value})


def clear(
    rendezvous: Mapping[str, Mapping[str, str]] | None, keep: frozenset[str] = frozenset()
) -> tuple[PatchData, ...]:
    """Drop every key of every shard (between epochs, once the old policy pods are gone)
    but the rollout entries written by the pods of ``keep`` (uids: the rollout replicas
    that keep running across a policy restart, whose counts carry over)."""
    out = []
    for name, data in sorted((rendezvous or {}).items()):
        drop = sorted(key for key, value in data.items() if not _kept(key, value, keep))
        if drop:
            out.append(PatchData(name, dict.fromkeys(drop)))
    return tuple(out)


def _kept(key: str, value: str, keep: frozenset[str]) -> bool:
    parsed = parse_key(key)
    if not keep or parsed is None or parsed.role != "rollout":
        return False
    try:
        entry = decode_entry(key, value)
    except EntryError:
        return False
    return isinstance(entry, (MetadataEntry, ProgressEntry)) and entry.uid in keep
