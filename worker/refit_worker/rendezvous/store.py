"""The rendezvous store interface: what workers and the coordinator do through it.

:class:`RendezvousStore` is abstract over three primitives an implementation provides —
set one key of one shard, read one shard, and wait until a check over some shards'
data passes — and builds on them, the same for every implementation:

- the worker's steps (:meth:`publish_metadata`, :meth:`wait_membership`,
  :meth:`barrier`, :meth:`peers`, :meth:`write_progress`, :meth:`progress_all`,
  :meth:`preemption_notice`, :meth:`wait_preemption`);
- the coordinator's (:meth:`open_barrier`, :meth:`post_preemption`, :meth:`snapshot`),
  used by the benchmark and tests; the operator and the local runner take the same
  decisions (``refit_worker.contract.rendezvous.membership``) over their own writes.

Every write sets the writer's own key alone; every wait has a timeout whose error says
what it waited for.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.rendezvous import (
    BARRIER_KEY,
    CONTROL_SHARD,
    MAX_RANKS,
    MAX_UID_CHARS,
    PREEMPT_KEY,
    UID_PATTERN,
    BarrierEntry,
    Entry,
    EntryError,
    Layout,
    LivePod,
    MetadataEntry,
    PreemptNotice,
    ProgressEntry,
    ProgressState,
    RefitReport,
    SeedPointer,
    SeedReport,
    ServedVersion,
    Snapshot,
    Verification,
    decode_entry,
    encode_entry,
    membership,
    meta_key,
    parse_key,
    progress_key,
    read_snapshot,
    shards_needed,
)
from refit_worker.contract.roles import Role, check_role
from refit_worker.contract.waits import CancelFlag, WaitTimeout

T = TypeVar("T")

#: What a wait checks: the merged data of the watched shards -> a result, or None to go on.
Check = Callable[[Mapping[str, str]], "T | None"]


class RendezvousError(RuntimeError):
    """The store could not be read or written (API error, lost connection)."""


class RendezvousTimeout(WaitTimeout):
    """A rendezvous wait ran out of time; the message says what it waited for."""


class Preempted(Exception):
    """The job is being preempted: stop at this safe point and exit as preempted.

    One exception for every way a worker hears of it: a store's wait raises it when the
    job-wide notice of this epoch arrives (``notice`` is that notice), and
    ``RefitSession`` (``refit_worker.Preempted``, the same class) at a bucket or
    refit boundary after a signal or a notice.  ``weights_partial``: the stop came in the
    middle of an in-place refit, so the live weights hold a mix of two refits and must not
    be served.
    """

    def __init__(
        self,
        message: str,
        *,
        notice: PreemptNotice | None = None,
        weights_partial: bool = False,
    ) -> None:
        super().__init__(message)
        self.notice = notice
        self.weights_partial = weights_partial

    @classmethod
    def for_notice(cls, notice: PreemptNotice) -> Preempted:
        """The job-wide ``notice`` as an exception that names its epoch, reason and pod."""
        return cls(
            f"job preempted in epoch {notice.epoch}: {notice.reason} (pod {notice.pod})",
            notice=notice,
        )


class Removed(Exception):
    """This rollout rank is no longer wanted: a scale-down put it at or past the barrier's
    R.  The worker reports ``left`` at its refit boundary and exits 0."""

    def __init__(self, message: str, *, barrier: BarrierEntry) -> None:
        super().__init__(message)
        self.barrier = barrier


@dataclass(frozen=True, slots=True)
class Member:
    """Who a worker is in the rendezvous: its rank, the epoch it runs in (for a rollout
    rank: the policy epoch it last joined), its pod uid and its generation (0 for policy
    ranks)."""

    role: Role
    rank: int
    epoch: int
    uid: str
    generation: int = 0

    def __post_init__(self) -> None:
        check_role(self.role)
        checked = (("rank", self.rank), ("epoch", self.epoch), ("generation", self.generation))
        for name, value in checked:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"member {name} must be an int >= 0, got {value!r}")
        if not UID_PATTERN.fullmatch(self.uid):
            raise ValueError(
                f"pod uid {self.uid!r} is not 1..{MAX_UID_CHARS} characters of [-._a-zA-Z0-9]"
            )

    @classmethod
    def from_config(cls, config: WorkerConfig) -> Member:
        if not config.pod_uid:
            raise ValueError(
                "REFIT_POD_UID is empty: the rendezvous needs the pod uid to "
                "tell this pod's entries from a stale pod's"
            )
        return cls(config.role, config.rank, config.epoch, config.pod_uid, config.generation)


class RendezvousStore(ABC):
    """One interface over the ConfigMap and the file-backed store."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    # -- primitives an implementation provides ----------------------------------------

    @abstractmethod
    def _put(self, shard: int, key: str, value: str) -> None:
        """Set ``key`` of ``shard`` to ``value``, leaving every other key untouched."""

    @abstractmethod
    def _read(self, shard: int) -> dict[str, str]:
        """All keys of ``shard`` now."""

    @abstractmethod
    def _wait(
        self,
        shards: Sequence[int],
        check: Check[T],
        timeout: float,
        what: str,
        cancel: CancelFlag | None,
    ) -> T:
        """Until ``check`` over the merged data of ``shards`` returns non-None; raise
        RendezvousTimeout naming ``what`` after ``timeout`` seconds, WaitCancelled soon
        after ``cancel`` is set."""

    @abstractmethod
    def close(self) -> None:
        """Release what the store holds (connections); idempotent."""

    # -- generic --------------------------------------------------------------------------

    def put_entry(self, key: str, entry: Entry) -> None:
        """Encode ``entry`` and set ``key`` to it in the key's shard."""
        self._put(self.layout.shard_of(key), key, encode_entry(key, entry))

    def read_data(self) -> dict[str, str]:
        """The data of all shards, merged (each key from the map it belongs in)."""
        data: dict[str, str] = {}
        for shard in range(self.layout.shards):
            data.update(self._home(shard, self._read(shard)))
        return data

    def _home(self, shard: int, data: Mapping[str, str]) -> dict[str, str]:
        """The keys of ``shard``'s ``data`` that belong there: a key written into a map it
        does not belong in (a role's map holding the barrier, another role's entry) was
        written by someone the map's rights do not speak for, and is not read."""
        return self.layout.at_home(shard, data)

    def snapshot(self, epoch: int) -> Snapshot:
        """The decoded entries of ``epoch`` across all shards."""
        return self._decode(self.read_data(), epoch)

    def wait_for(
        self,
        what: str,
        check: Callable[[Snapshot], T | None],
        *,
        epoch: int,
        timeout: float,
        shards: Sequence[int] | None = None,
        cancel: CancelFlag | None = None,
    ) -> T:
        """Until ``check`` of the snapshot of ``epoch`` (over ``shards``, default all)
        returns non-None."""
        _check_timeout(timeout, what)
        watched = list(range(self.layout.shards)) if shards is None else list(shards)
        return self._wait(
            watched, lambda data: check(self._decode(data, epoch)), timeout, what, cancel
        )

    # -- worker side ----------------------------------------------------------------------

    def publish_metadata(
        self, me: Member, agent_json: str, seed: SeedPointer | None = None
    ) -> None:
        """Publish this rank's NIXL agent metadata (opaque JSON text) for its epoch, and
        where peers may seed from it (a rollout rank that committed a refit)."""
        entry = MetadataEntry(
            epoch=me.epoch,
            uid=me.uid,
            role=me.role,
            rank=me.rank,
            generation=me.generation,
            agent=agent_json,
            seed=seed,
        )
        self.put_entry(meta_key(me.role, me.rank), entry)

    def barrier(self, epoch: int | None = None) -> BarrierEntry | None:
        """The latest membership now written (of ``epoch``, or of any epoch for None)."""
        value = self._home(CONTROL_SHARD, self._read(CONTROL_SHARD)).get(BARRIER_KEY)
        if value is None:
            return None
        entry = _decode_cached(BARRIER_KEY, value)
        if not isinstance(entry, BarrierEntry) or (epoch is not None and entry.epoch != epoch):
            return None
        return entry

    def wait_membership(
        self, me: Member, timeout: float, cancel: CancelFlag | None = None
    ) -> BarrierEntry:
        """The first membership of an epoch >= ``me.epoch`` whose slot ``me.rank`` holds
        ``(me.uid, me.generation)``.

        A rollout ``me`` that sees a membership of a later epoch (the policy gang was
        restarted) rewrites its own meta for that epoch (same agent) and waits to be
        listed there; the result's ``epoch`` is the one it joined.  Raises
        :class:`Preempted` on a notice that stops ``me`` (or when another pod holds a
        rollout rank's slot: this pod is stale), :class:`Removed` when a scale-down left a
        rollout rank past R, EntryError when the membership of a policy rank's epoch lists
        another pod, WaitCancelled soon after ``cancel`` is set.
        """
        what = f"the barrier of epoch {me.epoch} (key {BARRIER_KEY!r})"
        _check_timeout(timeout, what)
        joined = [me.epoch]

        def listed(data: Mapping[str, str]) -> BarrierEntry | None:
            barrier = self._listed(me, joined[-1], data)
            if barrier is not None and barrier.epoch == joined[-1]:
                return barrier
            # A later epoch's barrier, or a new policy gang that published before any:
            # its first barrier opens only once every rollout slot's pod published for
            # it, this one's too (a replacement started just before the policy gang's
            # restart waited for its old epoch's barrier while the new one waited for it).
            later = barrier.epoch if barrier is not None else _newest_policy_epoch(me, data)
            if later > joined[-1]:
                # Rejoin inside the one wait, so that its timeout covers the whole of it.
                self._rejoin(me, later)
                joined.append(later)
            return None

        # The operator's map, and the policy ranks' (a new gang's metadata).
        watched = [CONTROL_SHARD, *self.layout.role_shards("policy")]
        return self._wait(watched, listed, timeout, what, cancel)

    def wait_barrier(
        self, me: Member, timeout: float, cancel: CancelFlag | None = None
    ) -> BarrierEntry:
        """:meth:`wait_membership` (kept for callers of protocol v2's name)."""
        return self.wait_membership(me, timeout, cancel)

    def _listed(self, me: Member, joined: int, data: Mapping[str, str]) -> BarrierEntry | None:
        """One look for :meth:`wait_membership`: the barrier once it lists ``me`` in epoch
        ``joined``, or a rollout rank's barrier of a later epoch (to rejoin); else None."""
        notice = _notice_for(me, joined, data)
        if notice is not None:
            raise Preempted.for_notice(notice)
        value = data.get(BARRIER_KEY)
        barrier = None if value is None else _decode_cached(BARRIER_KEY, value)
        if not isinstance(barrier, BarrierEntry) or barrier.epoch < joined:
            return None
        if barrier.policy_world_size != self.layout.policy_world_size:
            raise EntryError(
                BARRIER_KEY,
                f"lists {barrier.policy_world_size} policy ranks, "
                f"the job has {self.layout.policy_world_size}",
            )
        if me.role == "policy":
            if barrier.epoch != me.epoch:
                return None  # the next gang's: a notice stops this pod
            if barrier.is_member(me.role, me.rank, me.uid, me.generation):
                return barrier
            held = barrier.holder(me.role, me.rank)
            raise EntryError(
                BARRIER_KEY,
                f"lists pod uid {held.uid if held else None!r} for policy rank {me.rank}, "
                f"but this pod is {me.uid!r}",
            )
        if barrier.epoch > joined or barrier.is_member(me.role, me.rank, me.uid, me.generation):
            return barrier
        if me.rank >= barrier.rollout_world_size:
            raise Removed(
                f"rollout rank {me.rank} is past the {barrier.rollout_world_size} rollout "
                f"ranks of membership version {barrier.version} (epoch {barrier.epoch})",
                barrier=barrier,
            )
        holder = barrier.holder(me.role, me.rank)
        if holder is not None and holder.uid != me.uid:
            raise Preempted(
                f"rollout rank {me.rank}: pod {holder.uid!r} (generation {holder.generation}) "
                f"holds this rank now; this pod ({me.uid!r}) is stale"
            )
        return None  # not listed yet: the coordinator adds it once it sees the meta

    def _rejoin(self, me: Member, epoch: int) -> None:
        """Rewrite a rollout rank's own meta (same agent) for the later ``epoch``."""
        key = meta_key(me.role, me.rank)
        value = self._read(self.layout.shard_of(key)).get(key)
        own = None if value is None else decode_entry(key, value)
        if not isinstance(own, MetadataEntry) or (own.uid, own.generation) != (
            me.uid,
            me.generation,
        ):
            raise EntryError(key, f"does not hold this pod's ({me.uid!r}) metadata to rejoin with")
        self.put_entry(key, own.model_copy(update={"epoch": epoch}))

    def follow(self, barrier: BarrierEntry) -> None:
        """Grow the layout to the membership's R after a scale-up, so that reads cover
        the shards that hold the new ranks' keys (shards are cut by index: no existing
        key moves).  Never shrinks: keys of ranks past R are ignored by every reader."""
        policy = self.layout.policy_world_size
        rollout = max(self.layout.rollout_world_size, barrier.rollout_world_size)
        shards = max(self.layout.shards, shards_needed(policy, rollout))
        if (rollout, shards) != (self.layout.rollout_world_size, self.layout.shards):
            self.layout = Layout(policy, rollout, shards)

    def peers(self, me: Member, barrier: BarrierEntry) -> dict[tuple[Role, int], MetadataEntry]:
        """The metadata of every member of ``barrier`` (every policy rank, the rollout
        ranks holding a slot), each checked against the uid and generation the barrier
        recorded for it."""
        self.follow(barrier)
        snap = read_snapshot(
            self.read_data(),
            barrier.epoch,
            barrier.policy_world_size,
            barrier.rollout_world_size,
            _decode_cached,
        )
        found: dict[tuple[Role, int], MetadataEntry] = {}
        ranks: list[tuple[Role, int]] = [("policy", r) for r in range(barrier.policy_world_size)]
        ranks += [("rollout", r) for r in barrier.members()]
        for role, rank in ranks:
            key, held = meta_key(role, rank), barrier.holder(role, rank)
            entry = snap.meta.get((role, rank))
            if entry is None or held is None:
                raise EntryError(
                    key, f"missing for epoch {barrier.epoch}, though the barrier lists it"
                )
            if entry.uid != held.uid:
                raise EntryError(
                    key, f"written by pod uid {entry.uid!r}, but the barrier recorded {held.uid!r}"
                )
            if entry.generation != held.generation:
                raise EntryError(
                    key,
                    f"written by generation {entry.generation} of pod uid {entry.uid!r}, "
                    f"but the barrier recorded generation {held.generation}",
                )
            found[(role, rank)] = entry
        return found

    def write_progress(
        self,
        me: Member,
        *,
        state: ProgressState = "running",
        first_refit: int = 0,
        refits_completed: int = 0,
        bytes_total: int = 0,
        seconds_total: float = 0.0,
        recent: tuple[RefitReport, ...] = (),
        verification: Verification = "none",
        message: str = "",
        seed: SeedReport | None = None,
        seeding: bool = False,
        serving: ServedVersion | None = None,
    ) -> ProgressEntry:
        """Report this rank's progress in its epoch (replaces its previous report); a
        :class:`~refit_worker.contract.progress.ProgressLog` gives the fields."""
        entry = ProgressEntry(
            epoch=me.epoch,
            uid=me.uid,
            role=me.role,
            rank=me.rank,
            generation=me.generation,
            state=state,
            first_refit=first_refit,
            refits_completed=refits_completed,
            bytes_total=bytes_total,
            seconds_total=seconds_total,
            recent=recent,
            verification=verification,
            message=message,
            seed=seed,
            seeding=seeding,
            serving=serving,
        )
        self.put_entry(progress_key(me.role, me.rank), entry)
        return entry

    def progress_all(self) -> dict[tuple[Role, int], ProgressEntry]:
        """The latest progress entry of every rank, whatever its epoch."""
        found: dict[tuple[Role, int], ProgressEntry] = {}
        for key, value in sorted(self.read_data().items()):
            parsed = parse_key(key)
            if parsed is None or parsed.kind != "progress":
                continue
            entry = _decode_cached(key, value)
            if isinstance(entry, ProgressEntry):
                found[(entry.role, entry.rank)] = entry
        return found

    def preemption_notice(self, me: Member) -> PreemptNotice | None:
        """The preemption notice that stops ``me`` now, if there is one (see
        :func:`_notice_for`)."""
        return _notice_for(me, me.epoch, self._home(CONTROL_SHARD, self._read(CONTROL_SHARD)))

    def wait_preemption(
        self, me: Member, timeout: float, cancel: CancelFlag | None = None
    ) -> PreemptNotice:
        """Block until a preemption notice that stops ``me`` is posted (see
        :class:`~.watch.PreemptionWatch` to do it in the background)."""
        what = f"a preemption notice for epoch {me.epoch} (key {PREEMPT_KEY!r})"
        _check_timeout(timeout, what)
        check: Check[PreemptNotice] = lambda data: _notice_for(me, me.epoch, data)  # noqa: E731
        return self._wait([CONTROL_SHARD], check, timeout, what, cancel)

    # -- coordinator side -----------------------------------------------------------------

    def open_barrier(self, epoch: int, timeout: float) -> BarrierEntry:
        """Wait until every rank of ``epoch`` published, then write the membership with
        every rank a member (the whole-gang opening, for benchmarks and tests)."""
        policy, rollout = self.layout.policy_world_size, self.layout.rollout_world_size
        what = f"metadata of all {policy + rollout} ranks of epoch {epoch}"
        _check_timeout(timeout, what)

        def ready(data: Mapping[str, str]) -> BarrierEntry | None:
            # Counting keys is cheap; decoding a thousand entries on each of a thousand
            # publishes is not.  Fewer meta keys than ranks cannot be a full epoch.
            if sum(key.startswith("meta.") for key in data) < policy + rollout:
                return None
            snap = self._decode(data, epoch)
            # Whoever published is taken as the live pod: there is no pod API here.
            live = {k: LivePod(m.uid, m.generation) for k, m in snap.meta.items()}
            barrier = membership(snap, policy, rollout, live, None)
            return None if barrier is None or None in barrier.rollout else barrier

        barrier = self._wait(list(range(self.layout.shards)), ready, timeout, what, None)
        self.put_entry(BARRIER_KEY, barrier)
        return barrier

    def post_preemption(self, notice: PreemptNotice) -> None:
        """Write the job-wide preemption notice (every rank of its epoch stops)."""
        self.put_entry(PREEMPT_KEY, notice)

    def _decode(self, data: Mapping[str, str], epoch: int) -> Snapshot:
        return read_snapshot(
            data,
            epoch,
            self.layout.policy_world_size,
            self.layout.rollout_world_size,
            _decode_cached,
        )


#: Waits decode the whole map on every change; most values did not change since the last
#: time, and decoding is pure, so remember the results.
_decode_cached = functools.lru_cache(maxsize=4 * MAX_RANKS)(decode_entry)


def _newest_policy_epoch(me: Member, data: Mapping[str, str]) -> int:
    """For a rollout ``me``: the latest epoch a policy rank published metadata for in
    ``data`` (-1: none, or ``me`` is a policy rank); an entry that does not decode is
    passed over here (the coordinator names it)."""
    if me.role != "rollout":
        return -1
    latest = -1
    for key, value in data.items():
        if key.startswith("meta.policy."):
            try:
                entry = _decode_cached(key, value)
            except EntryError:
                continue
            if isinstance(entry, MetadataEntry):
                latest = max(latest, entry.epoch)
    return latest


def _notice_for(me: Member, joined: int, data: Mapping[str, str]) -> PreemptNotice | None:
    """The notice in ``data`` that stops ``me``: of its epoch for a policy rank; for a
    rollout rank of the epoch it joined or a later one, unless the notice stops only the
    policy gang (rollout ranks keep serving and rejoin the next epoch)."""
    value = data.get(PREEMPT_KEY)
    notice = None if value is None else _decode_cached(PREEMPT_KEY, value)
    if not isinstance(notice, PreemptNotice) or not notice.stops(me.role):
        return None
    if notice.epoch == me.epoch or (me.role == "rollout" and notice.epoch >= joined):
        return notice
    return None


def _check_timeout(timeout: float, what: str) -> None:
    if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(
            f"timeout for {what} must be a finite number of seconds > 0, got {timeout!r}"
        )
