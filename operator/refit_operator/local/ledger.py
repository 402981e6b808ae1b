"""``refit run``'s per-refit table, built from what the rollout ranks reported.

Each rollout pod's progress entry carries its own running totals and itemises its last
few refits.  The ledger keys everything by pod uid, as the job's status does
(:func:`refit_operator.core.byte_accounting.count_bytes`): each pod's latest totals and every
refit it itemised, so a pod is counted once however often it is read, and a pod that was
replaced, retired by a scale-down or outlived a policy restart stays counted.  Its rows
therefore always add up to the status's ``bytesTransferred``: a refit any pod itemised
gets a row (with how many pods' bytes it holds); whatever a sampler missed goes into one
row per epoch that says it is not itemised.

Pure: fed the rendezvous data the runner reads anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from refit_operator.api.models import PodBytes
from refit_operator.core.byte_accounting import bytes_received, count_bytes
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
    #: Bytes the rollout pods received for it, together.
    bytes: int
    #: Transfer and commit time of the slowest of those pods.
    seconds: float
    itemised: bool = True
    #: How many rollout pods' bytes the row holds.
    pods: int = 0

    @property
    def label(self) -> str:
        if self.itemised:
            return str(self.first)
        return f"{self.first}-{self.last}*" if self.last > self.first else f"{self.first}*"


def rollout_entries(data: Mapping[str, str]) -> list[ProgressEntry]:
    """The rollout progress entries of ``data`` (any epoch; bad ones skipped, the
    reconcile reports those)."""
    out = []
    for key, value in data.items():
        parsed = parse_key(key)
        if parsed is None or parsed.kind != "progress" or parsed.role != "rollout":
            continue
        try:
            entry = decode_entry(key, value)
        except EntryError:
            continue
        if isinstance(entry, ProgressEntry):  # the key's kind decides; for mypy
            out.append(entry)
    return out


class RefitLedger:
    """Accumulates rollout pods' progress entries over a run; :meth:`rows` reads it out."""

    def __init__(self) -> None:
        #: uid -> the pod's latest report (the one with the most bytes).
        self._latest: dict[str, ProgressEntry] = {}
        #: uid -> refit id -> (the epoch it was first seen in, its report).
        self._items: dict[str, dict[int, tuple[int, RefitReport]]] = {}
        self._counted: list[PodBytes] = []

    def ingest(self, data: Mapping[str, str]) -> None:
        """Take in the rollout progress entries of a rendezvous map's ``data``."""
        self.ingest_entries(rollout_entries(data))

    def ingest_entries(self, entries: Iterable[ProgressEntry]) -> None:
        """Take in progress entries (policy ones are skipped), as the reconcile's
        :func:`count_bytes` does."""
        rollout = [e for e in entries if e.role == "rollout"]
        self._counted = count_bytes(rollout, self._counted)
        for entry in rollout:
            before = self._latest.get(entry.uid)
            # A pod's reports only grow; an older one read late must not shrink totals.
            if before is None or _size(entry) >= _size(before):
                self._latest[entry.uid] = entry
            items = self._items.setdefault(entry.uid, {})
            for report in entry.recent:
                # The same refit id twice (moved again after a restart): the first one
                # gets the row, the other's bytes go to the epoch's not-itemised row.
                items.setdefault(report.refit, (entry.epoch, report))

    def most_committed(self) -> int:
        """The most refits any one rollout pod has reported committed (0: none yet)."""
        return max((e.refits_completed for e in self._latest.values()), default=0)

    @property
    def total_bytes(self) -> int:
        """What the rows add up to: the status's ``bytesTransferred`` for the same reads."""
        return bytes_received(self._counted)

    def rows(self) -> list[RefitRow]:
        rows = self._itemised_rows() + self._gap_rows()
        return sorted(rows, key=lambda r: (r.epoch, not r.itemised, r.first))

    def _itemised_rows(self) -> list[RefitRow]:
        by_refit: dict[tuple[int, int], list[RefitReport]] = {}
        for items in self._items.values():
            for refit, (epoch, report) in items.items():
                by_refit.setdefault((epoch, refit), []).append(report)
        return [
            RefitRow(
                epoch,
                refit,
                refit,
                sum(r.bytes for r in reports),
                max(r.seconds for r in reports),
                pods=len(reports),
            )
            for (epoch, refit), reports in by_refit.items()
        ]

    def _gap_rows(self) -> list[RefitRow]:
        """Per epoch (of each pod's latest report), the bytes its pods did not itemise."""
        gaps: dict[int, tuple[int, float, set[int], int]] = {}
        for uid, entry in self._latest.items():
            items = self._items.get(uid, {})
            rest = entry.bytes_total - sum(r.bytes for _, r in items.values())
            if rest <= 0:
                continue
            seconds = entry.seconds_total - sum(r.seconds for _, r in items.values())
            lost = set(range(entry.first_refit, entry.refits_completed)) - set(items)
            total, slowest, refits, pods = gaps.get(entry.epoch, (0, 0.0, set(), 0))
            gaps[entry.epoch] = (total + rest, max(slowest, seconds), refits | lost, pods + 1)
        return [
            RefitRow(
                epoch,
                min(lost, default=0),
                max(lost, default=0),
                total,
                max(seconds, 0.0),
                itemised=False,
                pods=pods,
            )
            for epoch, (total, seconds, lost, pods) in gaps.items()
        ]


def _size(entry: ProgressEntry) -> tuple[int, int]:
    return entry.bytes_total, entry.refits_completed
