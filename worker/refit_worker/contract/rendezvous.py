"""The rendezvous protocol, as pure data and pure decisions.

Holds (re-exported from :mod:`.entries`) the key names, the typed entries a key may carry
(each with protocol version, epoch and the writer's pod uid) and their encoding and
decoding (every error names the key); (re-exported from :mod:`.shards`) which ConfigMap
holds each key (:class:`Layout`: the operator's map, then each role's); and here the
decisions the coordinator (the operator, or the local
runner) takes from what ranks published: the membership of an epoch (:func:`membership`),
what the job's progress is, what a preemption notice says.  docs/failure-domains.md is
the design.

Reading rules, so every reader acts alike:

- policy entries of another epoch are ignored (stale pods, or pods of the next gang);
  rollout ``meta`` counts only of the epoch, rollout ``progress`` of any epoch (a rollout
  rank's count carries across policy epochs); whose pod wrote an entry (uid, generation)
  is for the deciding function to check against the live pods;
- entries of ranks at or past the world sizes are ignored (stale after a scale-down);
- a value that is not JSON, does not match its key's schema, speaks another protocol
  version, is over its size limit, or sits under another rank's key is an
  :class:`EntryError` naming the key, whatever its epoch (its epoch cannot be trusted);
- a key outside the grammar below is ignored, so tools may annotate the map.

Keys (valid ConfigMap data keys): ``meta.<role>.<rank>``, ``progress.<role>.<rank>``
(in their role's maps), ``barrier`` and ``preempt`` (the operator's map, shard 0, which
workers only read).  A key is read only from the map it belongs in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from refit_worker.contract.entries import (
    BARRIER_KEY,
    MAX_GENERATION,
    MAX_META_BYTES,
    MAX_PREEMPT_BYTES,
    MAX_PROGRESS_BYTES,
    MAX_RANKS,
    MAX_UID_CHARS,
    PREEMPT_KEY,
    PROTOCOL_VERSION,
    RANKS_PER_SHARD,
    RECENT_REFITS,
    SHARD_BUDGET_BYTES,
    UID_PATTERN,
    VERIFICATION_ORDER,
    BarrierEntry,
    Entry,
    EntryError,
    Key,
    KeyKind,
    MetadataEntry,
    PreemptNotice,
    ProgressEntry,
    ProgressState,
    RefitReport,
    RolloutMember,
    SeedPointer,
    SeedReport,
    ServedVersion,
    Verification,
    decode_entry,
    encode_entry,
    is_valid_data_key,
    max_value_bytes,
    meta_key,
    parse_key,
    progress_key,
)
from refit_worker.contract.membership import (
    LivePod,
    Snapshot,
    check_membership,
    membership,
    read_snapshot,
)
from refit_worker.contract.roles import ROLES, Role, check_role
from refit_worker.contract.shards import (
    CONTROL_SHARD,
    Layout,
    Place,
    at_home,
    home_of_key,
    merge_patch,
    place_name,
    place_of_name,
    place_of_shard,
    shard_of,
    shard_of_key,
    shards_needed,
)

__all__ = [
    "BARRIER_KEY",
    "CONTROL_SHARD",
    "MAX_GENERATION",
    "MAX_META_BYTES",
    "MAX_PREEMPT_BYTES",
    "MAX_PROGRESS_BYTES",
    "MAX_RANKS",
    "MAX_UID_CHARS",
    "PREEMPT_KEY",
    "PROTOCOL_VERSION",
    "RANKS_PER_SHARD",
    "RECENT_REFITS",
    "ROLES",
    "SHARD_BUDGET_BYTES",
    "UID_PATTERN",
    "VERIFICATION_ORDER",
    "BarrierEntry",
    "Entry",
    "EntryError",
    "Key",
    "KeyKind",
    "Layout",
    "LivePod",
    "MetadataEntry",
    "Place",
    "PreemptNotice",
    "ProgressEntry",
    "ProgressState",
    "ProgressSummary",
    "RefitReport",
    "RolloutMember",
    "SeedPointer",
    "SeedReport",
    "ServedVersion",
    "Snapshot",
    "Verification",
    "aggregate_progress",
    "at_home",
    "check_membership",
    "check_role",
    "decode_entry",
    "encode_entry",
    "home_of_key",
    "is_valid_data_key",
    "make_preempt_notice",
    "max_value_bytes",
    "membership",
    "merge_patch",
    "meta_key",
    "parse_key",
    "place_name",
    "place_of_name",
    "place_of_shard",
    "progress_key",
    "read_snapshot",
    "shard_of",
    "shard_of_key",
    "shards_needed",
    "weakest",
]


# -- decisions -----------------------------------------------------------------------------


def make_preempt_notice(
    epoch: int, pod: str, uid: str, reason: str, role: Literal["policy"] | None = None
) -> PreemptNotice:
    """The notice the coordinator writes when a pod of ``epoch`` is disrupted: for every
    rank (``role`` None) or only the policy gang (``role`` "policy")."""
    return PreemptNotice(epoch=epoch, pod=pod, uid=uid, reason=reason, role=role)


@dataclass(frozen=True, slots=True)
class ProgressSummary:
    """What the job's status shows of an epoch's progress, from the ranks' own reports."""

    refits_completed: int
    bytes_total: int
    last_refit_seconds: float
    last_refit_gbps: float
    ranks_reporting: int
    ranks_done: int
    ranks_preempted: int
    ranks_failed: int
    #: The weakest check any rollout rank applied to the refits it committed ("none" when
    #: none reported one): the job's status never claims more than every rank did.
    verification: Verification = "none"
    #: Ranks whose last report says ``done``: their work is on record even once their pod
    #: is gone (a drained node, a finished pod deleted).
    done: frozenset[tuple[Role, int]] = frozenset()
    #: Every rollout rank reported ``done``.
    rollout_done: bool = False


def weakest(methods: Iterable[Verification]) -> Verification:
    """The least of ``methods`` in :data:`VERIFICATION_ORDER` ("none" for no methods)."""
    ranks = [VERIFICATION_ORDER.index(m) for m in methods]
    return VERIFICATION_ORDER[min(ranks)] if ranks else "none"


def aggregate_progress(
    snap: Snapshot,
    policy_world_size: int,
    rollout_world_size: int,
    live: Mapping[tuple[Role, int], LivePod] | None = None,
) -> ProgressSummary:
    """Fold per-rank progress into the job's numbers, over the rollout slots < R.

    With ``live``, a rollout slot counts only the report of the pod now holding it (uid
    match): a replaced pod's report is not the slot's; a slot no pod holds keeps its last
    report (a finished pod drained or deleted: its work is on record).  A refit counts once every
    rollout slot committed it (the minimum; a silent slot counts 0).  Bytes are what the
    reporting rollout ranks received.  The last refit took as long as its slowest rollout
    rank, and its throughput is all bytes it moved over that time; a rank already one
    refit ahead contributes its own latest refit, which moves the same weights, so the
    figure stays honest.
    """

    def slot(rank: int) -> ProgressEntry | None:
        entry = snap.progress.get(("rollout", rank))
        if entry is None or live is None:
            return entry
        pod = live.get(("rollout", rank))
        return entry if pod is None or pod.uid == entry.uid else None

    rollout = [slot(r) for r in range(rollout_world_size)]
    policy = [
        p
        for (role, rank), p in sorted(snap.progress.items())
        if role == "policy" and rank < policy_world_size
    ]
    reported = policy + [p for p in rollout if p is not None]
    refits = min((p.refits_completed if p is not None else 0) for p in rollout)
    lasts = [p.last_refit for p in rollout if p is not None and p.last_refit is not None]
    seconds = max((last.seconds for last in lasts), default=0.0)
    last_bytes = sum(last.bytes for last in lasts)
    committing = [p for p in rollout if p is not None and p.recent]
    return ProgressSummary(
        refits_completed=refits,
        bytes_total=sum(p.bytes_total for p in rollout if p is not None),
        last_refit_seconds=seconds,
        last_refit_gbps=last_bytes / seconds / 1e9 if seconds > 0 else 0.0,
        ranks_reporting=len(reported),
        ranks_done=sum(p.state == "done" for p in reported),
        ranks_preempted=sum(p.state == "preempted" for p in reported),
        ranks_failed=sum(p.state == "failed" for p in reported),
        # A rank that committed nothing yet checked nothing: it does not lower the method.
        verification=weakest(p.verification for p in committing) if committing else "none",
        done=frozenset((p.role, p.rank) for p in reported if p.state == "done"),
        rollout_done=all(p is not None and p.state == "done" for p in rollout),
    )
