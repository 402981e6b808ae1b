"""Which rollout peers a new rollout pod may seed from, decided from the membership, the
peers' published metadata and their progress: pure functions, no I/O (plus the pod's
start time, read once from ``/proc``).

A peer qualifies when it holds its slot now (the barrier lists the same pod uid and
generation its metadata was written by), offers a seed (``seed`` in its metadata), and
its pod's own progress report says it committed a refit at least ``min_refit`` and is
running or done (not failed, preempted or left).  The best offers come first: the highest
committed refit, then the lowest rank.  Whether a peer's copy is still intact is not
decided here: the seed's READ is verified tensor by tensor
(:mod:`refit_worker.engine.rollout.seed_transfer`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from refit_worker.contract.entries import (
    BarrierEntry,
    EntryError,
    MetadataEntry,
    ProgressEntry,
    decode_entry,
    meta_key,
    progress_key,
)
from refit_worker.contract.roles import Role
from refit_worker.engine import NixlAgentMetadata, SeedSource, metadata_from_pointer
from refit_worker.rendezvous.store import Member
from refit_worker.session.following import members

_IMPORTED_AT = time.time()


def label(rank: int) -> str:
    """How a seed's source is named in reports and status: ``rollout-<rank>``."""
    return f"rollout-{rank}"


def seed_sources(
    barrier: BarrierEntry,
    meta: Mapping[tuple[Role, int], MetadataEntry],
    progress: Mapping[tuple[Role, int], ProgressEntry],
    *,
    me: int,
    min_refit: int,
    layout: Mapping[str, Any] | None = None,
) -> list[SeedSource]:
    """The peers rollout rank ``me`` may seed from, best first (see the module docstring).

    Only peers that declared the same part of the model as ``layout`` (this rank's
    published target layout): a tensor-parallel worker seeds from a worker of its own
    tensor-parallel rank, never from one that holds other rows of the same shapes."""
    found: list[tuple[int, int, SeedSource]] = []
    for rank, (uid, generation) in members(barrier).items():
        entry, report = meta.get(("rollout", rank)), progress.get(("rollout", rank))
        if rank == me or entry is None or entry.seed is None or report is None:
            continue
        if (entry.uid, entry.generation) != (uid, generation) or report.uid != uid:
            continue
        if report.state not in ("running", "done") or report.refits_completed <= min_refit:
            continue
        source = _source(label(rank), entry)
        if source is not None and source.agent.layout == layout:
            found.append((-report.refits_completed, rank, source))
    return [source for _, _, source in sorted(found, key=lambda f: (f[0], f[1]))]


def predecessor(
    data: Mapping[str, str], rank: int, uid: str, generation: int
) -> tuple[int, SeedSource] | None:
    """The offer of the pod rollout rank ``rank``'s pod ``uid`` replaces: its metadata and
    progress still under the rank's keys, of an older generation, with a seed pointer and
    a committed refit; (its committed refits, the source) or None.  Read before the new
    pod publishes under those keys; whether it still answers, the READ tells."""
    meta_value = data.get(meta_key("rollout", rank))
    progress_value = data.get(progress_key("rollout", rank))
    if meta_value is None or progress_value is None:
        return None
    try:
        meta = decode_entry(meta_key("rollout", rank), meta_value)
        report = decode_entry(progress_key("rollout", rank), progress_value)
    except EntryError:
        return None
    if not isinstance(meta, MetadataEntry) or not isinstance(report, ProgressEntry):
        return None
    if meta.uid == uid or meta.generation >= generation or meta.seed is None:
        return None
    if report.uid != meta.uid or report.refits_completed == 0:
        return None
    source = _source(f"{label(rank)}-g{meta.generation}", meta)
    return None if source is None else (report.refits_completed, source)


def _source(name: str, entry: MetadataEntry) -> SeedSource | None:
    """Where ``entry``'s pod offers its seed, as ``name``; None if it offers none or
    published garbage (a peer like that offers nothing)."""
    pointer = entry.seed
    if pointer is None:
        return None
    try:
        agent = NixlAgentMetadata.model_validate_json(entry.agent)
        region_metadata = metadata_from_pointer(pointer.metadata)
    except ValueError:
        return None
    region = (pointer.addr, pointer.nbytes, pointer.dev_id)
    return SeedSource(name, agent, region, region_metadata)


def successor(report: ProgressEntry, member: Member) -> bool:
    """Whether ``report``, under ``member``'s progress key, is of a newer pod of the same
    rollout slot that serves (committed a refit)."""
    return (
        report.uid != member.uid
        and report.generation > member.generation
        and report.seed is not None
        and report.state in ("running", "done")
    )


def policy_done(
    barrier: BarrierEntry, progress: Mapping[tuple[Role, int], ProgressEntry], refits: int
) -> bool:
    """Whether every policy rank of the membership reported all ``refits`` sent
    (``done``) and none stays to serve late members (``seeding``): no send will come any
    more, late members are left to the rollout peers that stay."""
    for rank, uid in enumerate(barrier.policy_uids):
        report = progress.get(("policy", rank))
        if report is None or report.uid != uid or report.state != "done" or report.seeding:
            return False
        if report.refits_completed < refits:
            return False
    return True


def process_started_at() -> float:
    """When this process started (seconds since the epoch), from ``/proc``; where that is
    not readable, when this module was imported."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            # Field 22 (starttime, in clock ticks since boot); the command name (field 2)
            # may hold spaces, so count from its closing parenthesis.
            ticks = int(stat.read().rpartition(")")[2].split()[19])
        with open("/proc/stat", encoding="ascii") as system:
            boot = next(int(line.split()[1]) for line in system if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


__all__ = ["label", "policy_done", "predecessor", "process_started_at", "seed_sources", "successor"]
