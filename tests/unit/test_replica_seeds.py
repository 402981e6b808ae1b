"""Peer seeding as the operator shows it (issue #31): each rollout replica's status says
who sent its current pod's first committed refit and how soon the pod served, a
``ReplicaSeeded`` Event says so once, the metrics count seeds by source, and ``refit run``
prints it.

Pure: hand-made progress entries through the real reconcile, metrics and view.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tests.support.reconcile_harness import RUNNING, Harness, of

from refit_operator.api.models import Phase, RefitJobStatus, RolloutReplica, parse_spec
from refit_operator.api.status import decimal_bytes, seed_words
from refit_operator.core.coordinate import decode
from refit_operator.core.decision import Decision, Emit
from refit_operator.local import faults, view
from refit_operator.local.faults import Fault, Fired
from refit_operator.shell.metrics import OperatorMetrics, new_seeds
from refit_worker.contract.rendezvous import ProgressEntry, SeedReport, encode_entry, progress_key

SPEC: dict[str, Any] = {
    "image": "img",
    "policy": {"replicas": 1},
    "rollout": {"replicas": 2, "failurePolicy": {"maxReplacements": 2, "backoffSeconds": 1}},
}
JOB = Harness(SPEC)
POLICY, R0, R1 = "job-policy-0-e0", "job-rollout-0-g0", "job-rollout-1-g0"
ALL_UP = {POLICY: RUNNING, R0: RUNNING, R1: RUNNING}
FAILED: dict[str, Any] = {
    "phase": "Failed",
    "containerStatuses": [{"state": {"terminated": {"exitCode": 1}}}],
}
#: rollout-1 seeded by rollout-0: refit 3, 1.2 MB in 0.050 s, serving 2.3 s after start.
PEER = SeedReport(source="rollout-0", refit=3, bytes=1_200_000, seconds=0.05, serving_s=2.3)
POLICY_SEED = SeedReport(source="policy", refit=0, bytes=2_500, seconds=0.5, serving_s=7.25)
PEER_WORDS = "seeded from rollout-0: refit 3, 1.2 MB in 0.050 s, serving 2.3 s after its start"


def _running() -> RefitJobStatus:
    slots = [RolloutReplica(rank=r, pod=f"job-rollout-{r}-g0") for r in (0, 1)]
    return RefitJobStatus(
        phase=Phase.RUNNING, created_epoch=0, ready_epoch=0, rollout_replicas=slots
    )


def _entry(rank: int, uid: str, seed: SeedReport | None) -> dict[str, str]:
    key = progress_key("rollout", rank)
    entry = ProgressEntry(
        epoch=0, uid=uid, role="rollout", rank=rank, refits_completed=4, seed=seed
    )
    return {key: encode_entry(key, entry)}


def _replica(status: RefitJobStatus, rank: int) -> RolloutReplica:
    return next(r for r in status.rollout_replicas if r.rank == rank)


def _seeded_events(d: Decision) -> list[Emit]:
    return [e for e in of(d, Emit) if e.reason == "ReplicaSeeded"]


def _seeded(rank: int, pod: str, seed: SeedReport = PEER) -> RolloutReplica:
    return RolloutReplica(
        rank=rank,
        pod=pod,
        seeded_from=seed.source,
        seeded_refit=seed.refit,
        seeded_bytes=seed.bytes,
        seeded_seconds=seed.seconds,
        seconds_to_serving=seed.serving_s,
    )


def test_a_replicas_status_says_who_seeded_its_pod_and_how_soon_it_served() -> None:
    data = _entry(1, "uid-job-rollout-1-g0-0", PEER)
    d = JOB.run(_running(), JOB.pods(0, **ALL_UP), data)
    one = _replica(d.status, 1)
    assert (one.seeded_from, one.seeded_refit, one.seeded_bytes) == ("rollout-0", 3, 1_200_000)
    assert (one.seeded_seconds, one.seconds_to_serving) == (0.05, 2.3)
    raw = d.status.model_dump(mode="json", by_alias=True)["rolloutReplicas"][1]
    assert (raw["seededFrom"], raw["seededRefit"], raw["secondsToServing"]) == ("rollout-0", 3, 2.3)
    # rank 0 reported nothing of a seed: its fields stay empty.
    zero = _replica(d.status, 0)
    assert zero.seeded_from is None and zero.seconds_to_serving is None


def test_a_report_without_a_seed_or_of_another_pod_seeds_nothing() -> None:
    unseeded = JOB.run(_running(), JOB.pods(0, **ALL_UP), _entry(1, "uid-job-rollout-1-g0-0", None))
    assert _replica(unseeded.status, 1).seeded_from is None
    assert _seeded_events(unseeded) == []
    # A report under rank 1's key from a pod that no longer holds the slot (another uid).
    stale = JOB.run(_running(), JOB.pods(0, **ALL_UP), _entry(1, "uid-job-rollout-1-g9-0", PEER))
    assert _replica(stale.status, 1).seeded_from is None
    assert _seeded_events(stale) == []


def test_each_seeding_is_announced_once() -> None:
    data = _entry(1, "uid-job-rollout-1-g0-0", PEER)
    first = JOB.run(_running(), JOB.pods(0, **ALL_UP), data)
    (event,) = _seeded_events(first)
    assert event.type == "Normal"
    assert event.message == f"rollout-1 (pod {R1}) {PEER_WORDS}"
    again = JOB.run(first.status, JOB.pods(0, **ALL_UP), data)
    assert _seeded_events(again) == []
    assert _replica(again.status, 1) == _replica(first.status, 1)
    # The report gone (a cleared rendezvous): what the pod said of its first commit stays.
    gone = JOB.run(again.status, JOB.pods(0, **ALL_UP), {})
    assert _replica(gone.status, 1).seeded_from == "rollout-0" and _seeded_events(gone) == []


def test_a_replacement_starts_unseeded_and_its_own_seed_is_announced() -> None:
    seeded = JOB.run(_running(), JOB.pods(0, **ALL_UP), _entry(1, "uid-job-rollout-1-g0-0", PEER))
    failed = JOB.run(seeded.status, JOB.pods(0, **{**ALL_UP, R1: FAILED}))
    replaced = _replica(failed.status, 1)
    assert replaced.generation == 1 and replaced.seeded_from is None
    # Its replacement came up: the old pod's report (same key) does not seed it.
    pods = JOB.pods(0, rollout={0: 0, 1: 1}, **{POLICY: RUNNING, R0: RUNNING})
    pods[-1]["status"] = RUNNING
    old = _entry(1, "uid-job-rollout-1-g0-0", PEER)
    up = JOB.run(failed.status, pods, old)
    assert _replica(up.status, 1).seeded_from is None and _seeded_events(up) == []
    new = _entry(1, "uid-job-rollout-1-g1-0", POLICY_SEED)
    served = JOB.run(up.status, pods, new)
    assert _replica(served.status, 1).seeded_from == "policy"
    (event,) = _seeded_events(served)
    assert event.message == (
        "rollout-1 (pod job-rollout-1-g1) took its first refit from the policy: refit 0, "
        "2.5 kB in "
        "0.500 s, serving 7.2 s after its start"
    )


def test_a_spec_change_clears_every_slots_seed() -> None:
    seeded = JOB.run(_running(), JOB.pods(0, **ALL_UP), _entry(1, "uid-job-rollout-1-g0-0", PEER))
    changed = {**SPEC, "image": "img:2"}
    d = JOB.run(seeded.status, JOB.pods(0, **ALL_UP), spec=changed, generation=2)
    assert [r.seeded_from for r in d.status.rollout_replicas] == [None, None]
    assert [r.generation for r in d.status.rollout_replicas] == [1, 1]


def test_seed_words_and_sizes() -> None:
    assert seed_words(RolloutReplica(rank=0)) is None
    assert seed_words(_seeded(1, R1)) == PEER_WORDS
    assert [decimal_bytes(n) for n in (7, 2_500, 1_200_000, 3_000_000_000)] == [
        "7 B",
        "2.5 kB",
        "1.2 MB",
        "3.0 GB",
    ]


def _samples(metrics: OperatorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _key(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"namespace": "ns", "job": "demo", **labels}.items()))


def test_metrics_count_seeds_by_source_and_show_seconds_to_serving() -> None:
    metrics = OperatorMetrics(process_metrics=False)
    metrics.set_leader(True)
    entries = decode({})
    before = RefitJobStatus(rollout_replicas=[RolloutReplica(rank=0), RolloutReplica(rank=1)])
    # Already seeded when this process first saw the job: not counted as seen happening.
    metrics.job_round(
        "ns", "demo", before.model_copy(update={"rollout_replicas": [_seeded(0, R0)]}), entries
    )
    metrics.job_round("ns", "demo", before, entries)
    seeded = [_seeded(0, R0, POLICY_SEED), _seeded(1, R1)]
    after = before.model_copy(update={"rollout_replicas": seeded})
    metrics.job_round("ns", "demo", after, entries)
    metrics.job_round("ns", "demo", after, entries)  # the same seeds again: no new count
    got = _samples(metrics)
    assert got[("refit_rollout_seeds_total", _key(source="peer"))] == 1
    assert got[("refit_rollout_seeds_total", _key(source="policy"))] == 1
    assert got[("refit_job_rollout_replicas_seeded", _key(source="peer"))] == 1
    assert got[("refit_job_rollout_replicas_seeded", _key(source="policy"))] == 1
    assert got[("refit_job_rollout_replica_seconds_to_serving", _key(rank="1"))] == 2.3
    assert got[("refit_job_rollout_replica_seconds_to_serving", _key(rank="0"))] == 7.25
    metrics.job_gone("ns", "demo")
    assert not [k for k in _samples(metrics) if k[0] == "refit_rollout_seeds_total"]


def test_a_replacements_seed_counts_as_a_new_one() -> None:
    old = RefitJobStatus(rollout_replicas=[_seeded(1, R1)])
    new = RefitJobStatus(rollout_replicas=[_seeded(1, "job-rollout-1-g1", POLICY_SEED)])
    assert list(new_seeds(None, old)) == []
    assert list(new_seeds(old, old)) == []
    assert list(new_seeds(old, new)) == ["policy"]
    unseeded = RefitJobStatus(rollout_replicas=[RolloutReplica(rank=1, pod=R1)])
    assert list(new_seeds(unseeded, old)) == ["peer"]


def test_refit_run_shows_who_seeded_whom() -> None:
    status = RefitJobStatus(rollout_replicas=[RolloutReplica(rank=0, pod=R0), _seeded(1, R1)])
    zero, one = view.replica_lines(status)
    assert zero.endswith(f"pod {R0}")
    assert one.endswith(f"pod {R1}  seeded from rollout-0, serving 2.3 s after its start")
    assert view.seed_lines(status) == [f"rollout-1 {PEER_WORDS}"]
    spec = parse_spec({"image": "x", "rollout": {"replicas": 2}})
    assert view.status_line("j", spec, status, 1.0).endswith("gen0=0 gen1=0 seed1=rollout-0")
    unseeded = RefitJobStatus(
        rollout_replicas=[RolloutReplica(rank=0, pod=R0), RolloutReplica(rank=1, pod=R1)]
    )
    # The plain output prints a new status line when a seed first shows.
    assert view.status_key(status) != view.status_key(unseeded)
    event = Emit("Normal", "ReplicaSeeded", f"rollout-1 (pod {R1}) {PEER_WORDS}")
    assert view.event_line(event, 2.0) == (
        f"t=2.0s event type=Normal reason=ReplicaSeeded rollout-1 (pod {R1}) {PEER_WORDS}"
    )


def test_a_killed_replicas_replacement_seeded_by_a_peer_counts_as_recovered() -> None:
    uid_a, uid_b = "00000000-0000-0000-0000-00000000000a", "00000000-0000-0000-0000-00000000000b"
    key = progress_key("rollout", 0)
    # A peer's seed is not itemised in ``recent``: the seed alone says it committed.
    entry = ProgressEntry(epoch=0, uid=uid_b, role="rollout", rank=0, refits_completed=3, seed=PEER)
    latest = faults.latest_progress({key: entry.model_dump_json()})
    assert faults.replacement_committed(latest, "rollout", 0, uid_a)
    assert faults.replacement_seed(latest, "rollout", 0, uid_a) == "rollout-0"
    assert faults.replacement_seed(latest, "rollout", 0, uid_b) is None
    fired = Fired(Fault("kill-rollout", 1), "job-rollout-0-g0", uid_a, 3.0, frozenset({uid_b}))
    fired.recovered_s, fired.seeded_from = 1.5, "rollout-1"
    said = faults.outcome(fired, frozenset())
    assert (
        "its replacement committed its first refit 1.5 s after the kill (seeded from rollout-1); "
        in said
    )
    fired.seeded_from = "policy"
    assert "after the kill (sent by the policy); " in faults.outcome(fired, frozenset())
