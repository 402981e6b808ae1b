"""The rendezvous store interface: what workers and the coordinator do through it.

:class:`RendezvousStore` is abstract over three primitives an implementation provides —
set one key of one shard, read one shard, and wait until a check over some shards'
data passes — and builds on them, the same for every implementation:

- the worker's steps (:meth:`publish_metadata`, :meth:`wait_barrier`, :meth:`peers`,
  :meth:`write_progress`, :meth:`preemption_notice`, :meth:`wait_preemption`);
- the coordinator's (:meth:`open_barrier`, :meth:`post_preemption`, :meth:`snapshot`),
  used by the local runner and the benchmark; the operator takes the same decisions
  from :mod:`.protocol` over its own API calls.

Every write sets the writer's own key alone; every wait has a timeout whose error says
what it waited for.

Must not import: kubernetes (only :mod:`.configmap_store` talks to the API), torch,
nixl, the operator.
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
    MAX_RANKS,
    MAX_UID_CHARS,
    PREEMPT_KEY,
    UID_PATTERN,
    BarrierEntry,
    Entry,
    EntryError,
    Layout,
    MetadataEntry,
    PreemptNotice,
    ProgressEntry,
    ProgressState,
    RefitReport,
    Snapshot,
    Verification,
    barrier_ready,
    decode_entry,
    encode_entry,
    make_barrier,
    meta_key,
    progress_key,
    read_snapshot,
)
from refit_worker.contract.roles import Role, check_role
from refit_worker.waits import CancelFlag, WaitTimeout

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
    ``RefitSession`` (``refit_worker.session.Preempted``, the same class) at a bucket or
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


@dataclass(frozen=True, slots=True)
class Member:
    """Who a worker is in the rendezvous: its rank, the epoch it runs in, its pod uid."""

    role: Role
    rank: int
    epoch: int
    uid: str

    def __post_init__(self) -> None:
        check_role(self.role)
        for name, value in (("rank", self.rank), ("epoch", self.epoch)):
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
        return cls(config.role, config.rank, config.epoch, config.pod_uid)


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
        """The data of all shards, merged."""
        data: dict[str, str] = {}
        for shard in range(self.layout.shards):
            data.update(self._read(shard))
        return data

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

    def publish_metadata(self, me: Member, agent_json: str) -> None:
        """Publish this rank's NIXL agent metadata (opaque JSON text) for its epoch."""
        entry = MetadataEntry(
            epoch=me.epoch, uid=me.uid, role=me.role, rank=me.rank, agent=agent_json
        )
        self.put_entry(meta_key(me.role, me.rank), entry)

    def wait_barrier(
        self, me: Member, timeout: float, cancel: CancelFlag | None = None
    ) -> BarrierEntry:
        """The barrier of this rank's epoch, once the coordinator opened it.

        Raises :class:`Preempted` if a preemption notice of the epoch comes first,
        WaitCancelled soon after ``cancel`` is set (the pod is being stopped), and
        EntryError if the barrier lists another pod under this rank.
        """

        def opened(snap: Snapshot) -> BarrierEntry | None:
            if snap.preempt is not None:
                raise Preempted.for_notice(snap.preempt)
            return snap.barrier

        barrier = self.wait_for(
            f"the barrier of epoch {me.epoch} (key {BARRIER_KEY!r})",
            opened,
            epoch=me.epoch,
            timeout=timeout,
            shards=[0],
            cancel=cancel,
        )
        listed = barrier.uid_of(me.role, me.rank)
        if listed != me.uid:
            raise EntryError(
                BARRIER_KEY,
                f"lists pod uid {listed!r} for {me.role} rank "
                f"{me.rank}, but this pod is {me.uid!r}",
            )
        return barrier

    def peers(self, me: Member, barrier: BarrierEntry) -> dict[tuple[Role, int], MetadataEntry]:
        """Every rank's metadata of the barrier's epoch, each checked against the pod uid
        the barrier recorded for it."""
        snap = self.snapshot(barrier.epoch)
        found: dict[tuple[Role, int], MetadataEntry] = {}
        roles: tuple[tuple[Role, tuple[str, ...]], ...] = (
            ("policy", barrier.policy_uids),
            ("rollout", barrier.rollout_uids),
        )
        for role, uids in roles:
            for rank, uid in enumerate(uids):
                key = meta_key(role, rank)
                entry = snap.meta.get((role, rank))
                if entry is None:
                    raise EntryError(
                        key, f"missing for epoch {barrier.epoch}, though the barrier is open"
                    )
                if entry.uid != uid:
                    raise EntryError(
                        key, f"written by pod uid {entry.uid!r}, but the barrier recorded {uid!r}"
                    )
                found[(entry.role, rank)] = entry
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
    ) -> ProgressEntry:
        """Report this rank's progress in its epoch (replaces its previous report); a
        :class:`~refit_worker.contract.progress.ProgressLog` gives the fields."""
        entry = ProgressEntry(
            epoch=me.epoch,
            uid=me.uid,
            role=me.role,
            rank=me.rank,
            state=state,
            first_refit=first_refit,
            refits_completed=refits_completed,
            bytes_total=bytes_total,
            seconds_total=seconds_total,
            recent=recent,
            verification=verification,
            message=message,
        )
        self.put_entry(progress_key(me.role, me.rank), entry)
        return entry

    def preemption_notice(self, me: Member) -> PreemptNotice | None:
        """The preemption notice of this rank's epoch, if there is one now."""
        return self._decode(self._read(0), me.epoch).preempt

    def wait_preemption(
        self, me: Member, timeout: float, cancel: CancelFlag | None = None
    ) -> PreemptNotice:
        """Block until a preemption notice of this rank's epoch is posted (see
        :class:`~.watch.PreemptionWatch` to do it in the background)."""
        return self.wait_for(
            f"a preemption notice for epoch {me.epoch} (key {PREEMPT_KEY!r})",
            lambda snap: snap.preempt,
            epoch=me.epoch,
            timeout=timeout,
            shards=[0],
            cancel=cancel,
        )

    # -- coordinator side -----------------------------------------------------------------

    def open_barrier(self, epoch: int, timeout: float) -> BarrierEntry:
        """Wait until every rank of ``epoch`` published, then write the barrier."""
        policy, rollout = self.layout.policy_world_size, self.layout.rollout_world_size
        what = f"metadata of all {policy + rollout} ranks of epoch {epoch}"
        _check_timeout(timeout, what)

        def ready(data: Mapping[str, str]) -> Snapshot | None:
            # Counting keys is cheap; decoding a thousand entries on each of a thousand
            # publishes is not.  Fewer meta keys than ranks cannot be a full epoch.
            if sum(key.startswith("meta.") for key in data) < policy + rollout:
                return None
            snap = self._decode(data, epoch)
            return snap if barrier_ready(snap, policy, rollout) else None

        snap = self._wait(list(range(self.layout.shards)), ready, timeout, what, None)
        barrier = make_barrier(snap, policy, rollout)
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


def _check_timeout(timeout: float, what: str) -> None:
    if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(
            f"timeout for {what} must be a finite number of seconds > 0, got {timeout!r}"
        )
