"""Weight versions (issue #32, item 1): each rollout replica reports the version it
serves (the refit it committed last and the digest of that state's bytes); the status
carries the ledger of versions served and announces replicas that serve one refit with
different bytes.

Pure: real tensors through the real digest, hand-made progress entries through the real
reconcile and view.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from tests.support.reconcile_harness import RUNNING, Harness, of

from refit_operator.api.crd import crd_manifest
from refit_operator.api.models import Phase, RefitJobStatus, RolloutReplica
from refit_operator.api.status import ServedVersionRow, version_conflicts, version_ledger
from refit_operator.core.decision import Emit
from refit_operator.local import view
from refit_worker.contract.entries import DIGEST_PATTERN, MAX_PROGRESS_BYTES
from refit_worker.contract.rendezvous import (
    RECENT_REFITS,
    ProgressEntry,
    RefitReport,
    SeedReport,
    ServedVersion,
    encode_entry,
    progress_key,
)
from refit_worker.engine.messages.integrity import state_digest, tensors_digest


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "embed.weight": torch.randn(64, 16, generator=gen).to(torch.bfloat16),
        "layer.0.bias": torch.randn(16, generator=gen),
        "empty": torch.empty(0),
    }


def test_a_digest_names_its_algorithm_and_ignores_dict_order() -> None:
    state = _state()
    digest = tensors_digest(state)
    assert re.fullmatch(DIGEST_PATTERN, digest) and digest.startswith("xxh3_64:")
    assert tensors_digest(dict(reversed(list(state.items())))) == digest
    assert tensors_digest({k: v.clone() for k, v in state.items()}) == digest
    # Empty tensors carry no bytes and are left out, as a replica's offer leaves them.
    assert tensors_digest({k: v for k, v in state.items() if v.numel()}) == digest


@pytest.mark.parametrize("change", ["one byte", "name", "shape", "dtype"])
def test_any_change_to_the_state_changes_its_digest(change: str) -> None:
    state = _state()
    before = tensors_digest(state)
    embed = state["embed.weight"]
    if change == "one byte":
        embed.reshape(-1).view(torch.uint8)[123] ^= 1
    elif change == "name":
        state["embed.weights"] = state.pop("embed.weight")
    elif change == "shape":
        state["embed.weight"] = embed.reshape(16, 64)
    else:  # the same bytes read as another dtype
        state["embed.weight"] = embed.view(torch.float16)
    assert tensors_digest(state) != before


def test_the_digest_combines_per_tensor_hashes_whatever_their_order() -> None:
    rows = [("a", "float32", (2,), 1), ("b", "bfloat16", (3, 4), 2**64 - 1)]
    assert state_digest("xxh3_64", rows) == state_digest("xxh3_64", rows[::-1])
    assert state_digest("xxh3_64", rows) != state_digest("wsum64", rows)
    assert state_digest("xxh3_64", rows) != state_digest("xxh3_64", rows[:1])


def test_a_served_version_refuses_a_malformed_digest() -> None:
    ServedVersion(refit=3, digest="wsum64:0123456789abcdef")
    ServedVersion(refit=3, digest=None)
    for bad in ("0123456789abcdef", "md5:0123456789abcdef", "xxh3_64:0123"):
        with pytest.raises(ValidationError):
            ServedVersion(refit=3, digest=bad)


def test_the_largest_progress_report_still_fits_its_key() -> None:
    # Every field at the most a job can reach: 10**8 refits (a refit a second for three
    # years), bytes of a petabyte, seconds with a float's full repr, every text field at
    # its longest.
    many, most, secs = 10**8, 10**15, 123456.78901234567
    source = "rollout-999999999-g999999999"
    entry = ProgressEntry(
        epoch=10**9,
        uid="u" * 40,
        role="rollout",
        rank=4095,
        generation=999_999_999,
        state="preempted",
        first_refit=many,
        refits_completed=many,
        bytes_total=most,
        seconds_total=secs,
        recent=tuple(
            RefitReport(refit=many, bytes=most, seconds=secs) for _ in range(RECENT_REFITS)
        ),
        verification="served-params",
        message="m" * 200,
        seed=SeedReport(source=source, refit=many, bytes=most, seconds=secs, serving_s=secs),
        seeding=True,
        serving=ServedVersion(refit=many, digest="xxh3_64:" + "f" * 16),
    )
    key = progress_key("rollout", 4095)
    assert len(encode_entry(key, entry)) <= MAX_PROGRESS_BYTES


D1, D2 = "xxh3_64:" + "1" * 16, "xxh3_64:" + "2" * 16
K = "ed25519:" + "ab" * 8


def test_the_ledger_groups_replicas_by_version_newest_first() -> None:
    ledger = version_ledger(
        {2: (5, D1, K), 0: (5, D1, K), 1: (4, D2, K), 3: (5, None, None), 4: (5, D1, None)}
    )
    assert [(r.refit, r.digest, r.signed_by, r.replicas) for r in ledger] == [
        (5, None, None, [3]),
        (5, D1, None, [4]),  # the same bytes, but no signature was checked of them there
        (5, D1, K, [0, 2]),
        (4, D2, K, [1]),
    ]
    assert version_conflicts(ledger) == []  # no digest is no disagreement
    split = version_ledger({0: (5, D1, K), 1: (5, D2, K)})
    assert version_conflicts(split) == [5]
    assert version_ledger({}) == []


SPEC: dict[str, Any] = {"image": "img", "policy": {"replicas": 1}, "rollout": {"replicas": 2}}
JOB = Harness(SPEC)
POLICY, R0, R1 = "job-policy-0-e0", "job-rollout-0-g0", "job-rollout-1-g0"
ALL_UP = {POLICY: RUNNING, R0: RUNNING, R1: RUNNING}


def _running(versions: list[ServedVersionRow] | None = None) -> RefitJobStatus:
    slots = [RolloutReplica(rank=r, pod=f"job-rollout-{r}-g0") for r in (0, 1)]
    return RefitJobStatus(
        phase=Phase.RUNNING,
        created_epoch=0,
        ready_epoch=0,
        rollout_replicas=slots,
        versions=versions or [],
    )


def _serving(
    rank: int, uid: str, refit: int, digest: str | None, signed_by: str | None = None
) -> dict[str, str]:
    key = progress_key("rollout", rank)
    entry = ProgressEntry(
        epoch=0,
        uid=uid,
        role="rollout",
        rank=rank,
        refits_completed=refit + 1,
        serving=ServedVersion(refit=refit, digest=digest, signed_by=signed_by),
    )
    return {key: encode_entry(key, entry)}


def _mismatches(d: Any) -> list[Emit]:
    return [e for e in of(d, Emit) if e.reason == "VersionMismatch"]


def test_the_status_ledger_says_which_replica_serves_which_version() -> None:
    data = {
        **_serving(0, "uid-job-rollout-0-g0-0", 4, D1, K),
        **_serving(1, "uid-job-rollout-1-g0-0", 3, D2),
    }
    d = JOB.run(_running(), JOB.pods(0, **ALL_UP), data)
    raw = d.status.model_dump(mode="json", by_alias=True)["versions"]
    assert raw == [
        {"refit": 4, "digest": D1, "replicas": [0], "signedBy": K},
        {"refit": 3, "digest": D2, "replicas": [1], "signedBy": None},
    ]
    assert _mismatches(d) == []
    words = view.version_words(d.status.versions)
    assert words == [
        f"refit 4 {D1} signed {K} served by rollout-0",
        f"refit 3 {D2} served by rollout-1",
    ]


def test_a_replaced_pods_report_is_not_its_slots_version() -> None:
    # Rank 1's key holds a report of a pod that no longer holds the slot (another uid).
    data = {
        **_serving(0, "uid-job-rollout-0-g0-0", 4, D1),
        **_serving(1, "uid-job-rollout-1-g7-0", 4, D1),
    }
    d = JOB.run(_running(), JOB.pods(0, **ALL_UP), data)
    assert [(r.refit, r.replicas) for r in d.status.versions] == [(4, [0])]


def test_one_refit_served_with_two_digests_is_announced_once() -> None:
    data = {
        **_serving(0, "uid-job-rollout-0-g0-0", 4, D1),
        **_serving(1, "uid-job-rollout-1-g0-0", 4, D2),
    }
    first = JOB.run(_running(), JOB.pods(0, **ALL_UP), data)
    (event,) = _mismatches(first)
    assert event.type == "Warning"
    assert "refit 4" in event.message and D1 in event.message and D2 in event.message
    again = JOB.run(first.status, JOB.pods(0, **ALL_UP), data)
    assert _mismatches(again) == [] and again.status.versions == first.status.versions


def test_no_report_at_all_keeps_the_last_ledger() -> None:
    kept = [ServedVersionRow(refit=9, digest=D1, replicas=[0, 1])]
    d = JOB.run(_running(kept), JOB.pods(0, **ALL_UP), {})
    assert d.status.versions == kept


def test_the_crd_carries_the_ledger() -> None:
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    versions = schema["properties"]["status"]["properties"]["versions"]
    assert versions["type"] == "array"
    assert set(versions["items"]["properties"]) == {"refit", "digest", "replicas", "signedBy"}
