"""``refit run``'s per-refit rows: built from sampled progress entries, they always add up
to the bytes the ranks reported, whatever the sampler missed.  Pure; entries as data."""

from __future__ import annotations

from refit_operator.core.progress import bytes_received, count_bytes
from refit_operator.local.ledger import RefitLedger, rollout_entries
from refit_worker.contract.entries import ProgressState
from refit_worker.contract.progress import ProgressLog
from refit_worker.contract.rendezvous import ProgressEntry, encode_entry, progress_key


class Rank:
    """A rollout pod's progress log, encoded as the store would hold it; ``uid`` names
    the pod (default: one pod per rank and epoch)."""

    def __init__(self, rank: int, epoch: int = 0, first: int = 0, uid: str = "") -> None:
        self.rank, self.epoch = rank, epoch
        self.uid = uid or f"u{rank}-{epoch}"
        self.log = ProgressLog(first, verification="checksums")

    def refit(self, nbytes: int, seconds: float = 0.1) -> None:
        self.log.record(self.log.refits_completed, nbytes, seconds)

    def data(self, state: ProgressState = "running") -> dict[str, str]:
        key = progress_key("rollout", self.rank)
        entry = ProgressEntry(
            epoch=self.epoch,
            uid=self.uid,
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
    """Preempted mid-refit: rank 0 committed refit 2, rank 1 did not (its row holds
    one pod's bytes)."""
    ledger = RefitLedger()
    a, b = Rank(0), Rank(1)
    for _ in range(2):
        a.refit(100)
        b.refit(100)
    a.refit(100)
    ledger.ingest({**a.data("preempted"), **b.data("preempted")})
    rows = ledger.rows()
    assert [(r.label, r.bytes, r.pods) for r in rows] == [
        ("0", 200, 2),
        ("1", 200, 2),
        ("2", 100, 1),
    ]
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


def test_a_pod_that_outlives_a_policy_restart_is_counted_once() -> None:
    """A rollout pod joins the next policy epoch and its totals carry on: keyed by pod,
    its epoch-0 report and its epoch-1 report are one pod's (the 18 + 18 + 9 MiB rows
    beside a 27 MiB total of issue #30 counted it once per epoch)."""
    ledger = RefitLedger()
    pod = Rank(0, uid="pod-a")
    pod.refit(100)
    ledger.ingest(pod.data())
    pod.epoch = 1  # the policy gang restarted; the same pod rejoins
    pod.refit(100)
    ledger.ingest(pod.data("done"))
    rows = ledger.rows()
    assert [(r.epoch, r.label, r.bytes) for r in rows] == [(0, "0", 100), (1, "1", 100)]
    assert _total(ledger) == ledger.total_bytes == 200


def test_a_replaced_or_retired_pod_stays_counted() -> None:
    """Its key is taken by the replacement (or cleared): its bytes remain in the rows."""
    ledger = RefitLedger()
    old, other = Rank(0, uid="old"), Rank(1, uid="other")
    old.refit(100)
    other.refit(100)
    ledger.ingest({**old.data(), **other.data()})
    new = Rank(0, first=1, uid="new")
    new.refit(100)
    other.refit(100)
    ledger.ingest({**new.data("done"), **other.data("done")})  # old's key is new's now
    assert [(r.label, r.bytes, r.pods) for r in ledger.rows()] == [("0", 200, 2), ("1", 200, 2)]
    assert _total(ledger) == ledger.total_bytes == 400


def test_the_ledgers_total_is_the_status_count() -> None:
    """The rows, the total and ``status.bytesTransferred`` come from one function."""
    a, b = Rank(0), Rank(1)
    a.refit(100)
    b.refit(70)
    data = {**a.data(), **b.data()}
    ledger = RefitLedger()
    ledger.ingest(data)
    assert ledger.total_bytes == bytes_received(count_bytes(rollout_entries(data), [])) == 170


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
