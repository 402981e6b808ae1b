"""``refit run``'s per-refit rows: built from sampled progress entries, they always add up
to the bytes the ranks reported, whatever the sampler missed.  Pure; entries as data."""

from __future__ import annotations

from refit_operator.local.ledger import RefitLedger
from refit_worker.contract.entries import ProgressState
from refit_worker.contract.progress import ProgressLog
from refit_worker.contract.rendezvous import ProgressEntry, encode_entry, progress_key


class Rank:
    """A rollout rank's progress log, encoded as the store would hold it."""

    def __init__(self, rank: int, epoch: int = 0, first: int = 0) -> None:
        self.rank, self.epoch = rank, epoch
        self.log = ProgressLog(first, verification="checksums")

    def refit(self, nbytes: int, seconds: float = 0.1) -> None:
        self.log.record(self.log.refits_completed, nbytes, seconds)

    def data(self, state: ProgressState = "running") -> dict[str, str]:
        key = progress_key("rollout", self.rank)
        entry = ProgressEntry(
            epoch=self.epoch,
            uid=f"u{self.rank}-{self.epoch}",
            role="rollout",
            rank=self.rank,
            **self.log.fields(state),
        )
        return {key: encode_entry(key, entry)}


def _total(ledger: RefitLedger) -> int:
    return sum(row.bytes for row in ledger.rows())


def test_every_refit_seen_gets_its_own_row() -> None:
    ledger = RefitLedger()
    a, b = Rank(0), Rank(1)
    for _ in range(3):
        a.refit(100, 0.2)
        b.refit(100, 0.3)
        ledger.ingest({**a.data(), **b.data()})
    rows = ledger.rows()
    assert [(r.label, r.bytes, r.seconds) for r in rows] == [
        ("0", 200, 0.3),
        ("1", 200, 0.3),
        ("2", 200, 0.3),
    ]
    assert _total(ledger) == ledger.total_bytes == 600


def test_refits_finished_between_reads_still_add_up() -> None:
    """Read only at the end: the ring holds the last 8 of 20 refits."""
    ledger = RefitLedger()
    rank = Rank(0)
    for _ in range(20):
        rank.refit(10)
    ledger.ingest(rank.data("done"))
    rows = ledger.rows()
    assert [r.label for r in rows if r.itemised] == [str(k) for k in range(12, 20)]
    gap = [r for r in rows if not r.itemised]
    assert [(r.label, r.bytes) for r in gap] == [("0-11*", 120)]
    assert _total(ledger) == 200


def test_a_refit_only_some_ranks_committed_is_not_itemised() -> None:
    """Preempted mid-refit: rank 0 committed refit 2, rank 1 did not."""
    ledger = RefitLedger()
    a, b = Rank(0), Rank(1)
    for _ in range(2):
        a.refit(100)
        b.refit(100)
    a.refit(100)
    ledger.ingest({**a.data("preempted"), **b.data("preempted")})
    rows = ledger.rows()
    assert [(r.label, r.bytes) for r in rows] == [("0", 200), ("1", 200), ("2*", 100)]
    # The next epoch resumes at refit 2 and moves it again.
    a2, b2 = Rank(0, epoch=1, first=2), Rank(1, epoch=1, first=2)
    a2.refit(100)
    b2.refit(100)
    ledger.ingest({**a2.data("done"), **b2.data("done")})
    assert [(r.epoch, r.label) for r in ledger.rows()][-1] == (1, "2")
    assert _total(ledger) == ledger.total_bytes == 700


def test_an_older_report_read_late_does_not_shrink_the_totals() -> None:
    ledger = RefitLedger()
    rank = Rank(0)
    rank.refit(100)
    early = rank.data()
    rank.refit(100)
    ledger.ingest(rank.data())
    ledger.ingest(early)
    assert ledger.total_bytes == 200 and _total(ledger) == 200


def test_policy_entries_and_garbage_are_ignored() -> None:
    ledger = RefitLedger()
    ledger.ingest({"progress.rollout.0": "{not json", "barrier": "x", "unrelated": "y"})
    key = progress_key("policy", 0)
    entry = ProgressEntry(epoch=0, uid="p", role="policy", rank=0, bytes_total=5)
    ledger.ingest({key: encode_entry(key, entry)})
    assert ledger.rows() == [] and ledger.total_bytes == 0


def test_committed_bytes_go_with_the_refits_every_rank_committed() -> None:
    """The live view's bytes: a rank one refit ahead (27 MiB = 1.5 refits of 18 MiB
    before) does not count that refit until every rollout rank committed it."""
    ledger = RefitLedger()
    a, b = Rank(0), Rank(1)
    a.refit(100)
    ledger.ingest(a.data())
    assert ledger.committed_bytes(rollout_ranks=2) == 0  # rank 1 has not reported at all
    b.refit(100)
    a.refit(100)
    ledger.ingest({**a.data(), **b.data()})
    assert ledger.total_bytes == 300
    assert ledger.committed_bytes(rollout_ranks=2) == 200  # refit 0 on both ranks
    # Preempted there: the next epoch resumes at refit 1 and moves it again on both.
    a2, b2 = Rank(0, epoch=1, first=1), Rank(1, epoch=1, first=1)
    for rank in (a2, b2):
        rank.refit(100)
        rank.refit(100)
    ledger.ingest({**a2.data("done"), **b2.data("done")})
    assert ledger.committed_bytes(rollout_ranks=2) == 200 + 400


def test_committed_bytes_of_a_rank_further_ahead_than_its_ring_itemises() -> None:
    ledger = RefitLedger()
    a, b = Rank(0), Rank(1)
    for _ in range(12):
        a.refit(10)
    for _ in range(2):
        b.refit(10)
    ledger.ingest({**a.data(), **b.data()})
    # Refits 2-11 of rank 0 are not all in its ring of 8: each refit moves the same bytes.
    assert ledger.committed_bytes(rollout_ranks=2) == 20 + 20


def test_most_committed_is_the_first_rank_to_report_a_refit() -> None:
    """What ``--drain-at-refit`` waits for: one rollout rank's commit is enough."""
    ledger = RefitLedger()
    assert ledger.most_committed() == 0
    a, b = Rank(0), Rank(1)
    a.refit(100)
    ledger.ingest({**a.data(), **b.data()})
    assert ledger.most_committed() == 1
    b.refit(100)
    a.refit(100)
    ledger.ingest(a.data())
    assert ledger.most_committed() == 2
