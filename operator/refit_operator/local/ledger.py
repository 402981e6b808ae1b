"""``refit run``'s per-refit table, built from what the rollout ranks reported.

Each rank's progress entry itemises its last few refits and carries its epoch's totals.
The ledger keeps every itemised refit it has seen and each rank's latest totals, per epoch,
so its rows always add up to the bytes the ranks reported: a refit every rollout rank
itemised gets a row of its own; whatever a sampler missed (or a refit only some ranks
committed before a preemption) goes into one row per epoch that says it is not itemised.

Pure: fed the rendezvous data the runner reads anyway.  Must not import: kopf, kubernetes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from refit_worker.contract.rendezvous import (
    EntryError,
    ProgressEntry,
    RefitReport,
    decode_entry,
    parse_key,
)


@dataclass(frozen=True)
class RefitRow:
    """One row: a refit (``first == last``, itemised) or what an epoch did not itemise."""

    epoch: int
    first: int
    last: int
    #: Bytes all rollout ranks received for it.
    bytes: int
    #: Transfer and commit time of the slowest rollout rank.
    seconds: float
    itemised: bool = True

    @property
    def label(self) -> str:
        if self.itemised:
            return str(self.first)
        return f"{self.first}-{self.last}*" if self.last > self.first else f"{self.first}*"


class RefitLedger:
    """Accumulates rollout ranks' progress entries over a run; :meth:`rows` reads it out."""

    def __init__(self) -> None:
        self._latest: dict[tuple[int, int], ProgressEntry] = {}
        self._items: dict[tuple[int, int], dict[int, RefitReport]] = {}

    def ingest(self, data: Mapping[str, str]) -> None:
        """Take in the rollout progress entries of ``data`` (any epoch; bad ones skipped,
        the reconcile reports those)."""
        for key, value in data.items():
            parsed = parse_key(key)
            if parsed is None or parsed.kind != "progress" or parsed.role != "rollout":
                continue
            try:
                entry = decode_entry(key, value)
            except EntryError:
                continue
            if not isinstance(entry, ProgressEntry):  # the key's kind decides; for mypy
                continue
            slot = (entry.epoch, entry.rank)
            before = self._latest.get(slot)
            # Reports of a rank only grow; an older one read late must not shrink totals.
            if before is None or entry.refits_completed >= before.refits_completed:
                self._latest[slot] = entry
            self._items.setdefault(slot, {}).update((r.refit, r) for r in entry.recent)

    def most_committed(self) -> int:
        """The most refits any one rollout rank has reported committed (0: none yet)."""
        return max((e.refits_completed for e in self._latest.values()), default=0)

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes_total for e in self._latest.values())

    def committed_bytes(self, rollout_ranks: int) -> int:
        """Bytes of the refits every rollout rank of their epoch committed: what goes with
        the job's refit count (the minimum over ranks), not a rank already one refit on."""
        total = 0
        for epoch in sorted({epoch for epoch, _ in self._latest}):
            entries = [e for (ep, _), e in self._latest.items() if ep == epoch]
            if len(entries) < rollout_ranks:
                continue  # a silent rank committed nothing yet: no refit is everyone's
            upto = min(e.refits_completed for e in entries)
            for entry in entries:
                total += self._bytes_before(epoch, entry, upto)
        return total

    def _bytes_before(self, epoch: int, entry: ProgressEntry, upto: int) -> int:
        """Bytes ``entry``'s rank received for its refits before ``upto``."""
        done = entry.refits_completed - entry.first_refit
        if upto >= entry.refits_completed or done <= 0:
            return entry.bytes_total if upto >= entry.refits_completed else 0
        items = self._items.get((epoch, entry.rank), {})
        beyond = range(upto, entry.refits_completed)
        if all(r in items for r in beyond):
            return entry.bytes_total - sum(items[r].bytes for r in beyond)
        # Not itemised: every refit of a rank moves the same weights, so the same bytes.
        return entry.bytes_total * (upto - entry.first_refit) // done

    def rows(self) -> list[RefitRow]:
        out: list[RefitRow] = []
        for epoch in sorted({epoch for epoch, _ in self._latest}):
            out.extend(self._epoch_rows(epoch))
        return out

    def _epoch_rows(self, epoch: int) -> list[RefitRow]:
        ranks = sorted(rank for e, rank in self._latest if e == epoch)
        items = [self._items.get((epoch, rank), {}) for rank in ranks]
        full = sorted(set.intersection(*(set(i) for i in items))) if items else []
        rows = [
            RefitRow(
                epoch,
                refit,
                refit,
                sum(i[refit].bytes for i in items),
                max(i[refit].seconds for i in items),
            )
            for refit in full
        ]
        gap_bytes, gap_seconds, lost = 0, 0.0, set()
        for rank, rank_items in zip(ranks, items, strict=True):
            entry = self._latest[(epoch, rank)]
            gap_bytes += entry.bytes_total - sum(rank_items[r].bytes for r in full)
            gap_seconds = max(
                gap_seconds, entry.seconds_total - sum(rank_items[r].seconds for r in full)
            )
            lost |= set(range(entry.first_refit, entry.refits_completed)) - set(full)
        if gap_bytes > 0 or lost:
            first, last = (min(lost), max(lost)) if lost else (0, 0)
            rows.append(RefitRow(epoch, first, last, gap_bytes, max(gap_seconds, 0.0), False))
        return rows
