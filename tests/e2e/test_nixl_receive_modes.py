"""Receiving into final tensors through ``RefitSession``: double-buffered and in place.

Real: one policy and one rollout ``RefitSession`` in separate processes, the file-backed
rendezvous store (the test opens the barrier, as the operator would), real NIXL (UCX)
WRITEs straight into the rollout's tensors, integrity hashes on (the default), a real
SIGTERM (``os.kill``) for a preemption and a real SIGKILL for a dead peer.  The hooks:
the policy can be told to stall after the first bucket of a refit, so a refit is caught
half-way every time (``tests.support.session_procs.SessionJob.pause_at``), or to flip a
bit of a delta refit after encoding it (``corrupt_at``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from tests.support.engine_procs import expected
from tests.support.session_procs import JOB_SEED, SessionJob, run_session_job, sent_digests

from refit_worker.engine.messages.signing import RefitSigner

SIGNED_BY = RefitSigner(JOB_SEED).fingerprint


@pytest.mark.parametrize("mode", ["receive", "double_buffer", "in_place"])
def test_refits_land_bit_exact_in_final_tensors(tmp_path: Path, mode: str) -> None:
    job = SessionJob(mode=mode, refits=3)
    reports = run_session_job(job, tmp_path)
    rollout = reports["rollout"]
    assert "error" not in rollout and "error" not in reports["policy"], reports
    assert rollout["refits"] == [expected(k) for k in range(3)]
    pointers = rollout["pointers"]
    if mode == "in_place":
        # Straight into the live tensors: the same memory every refit.
        assert pointers[0] == pointers[1] == pointers[2]
        assert rollout["live"] == expected(2)
    elif mode == "double_buffer":
        # The commit swaps the served tensors between two copies.
        assert pointers[0] != pointers[1] and pointers[0] == pointers[2]
        assert rollout["live"] == expected(2)
    assert rollout["live_weights_partial"] is False


def test_landing_memory_reused_by_another_layout_keeps_refits_flowing(tmp_path: Path) -> None:
    """The rollout lands two layouts (names) in the same memory, as a rollout whose layout
    changes does once its allocator hands out memory an earlier landing set had: B's one
    storage holds A's (live, then swept and registered again) before B's tensors.  The
    policy's NIXL keeps every region it loaded of the rollout, so without reloading the
    rollout's metadata an old region hid the new one: NIXL_ERR_NOT_FOUND preparing refit
    1's WRITEs (the qwen2-moe engines case, docs/engines.md)."""
    job = SessionJob(mode="pool", refits=5, layouts="ABAAB")
    reports = run_session_job(job, tmp_path)
    rollout, policy = reports["rollout"], reports["policy"]
    assert "error" not in rollout and "error" not in policy, reports
    assert rollout["refits"] == [sent_digests(job, k) for k in range(job.refits)]
    assert "big.top" in rollout["refits"][1] and "big.weight" in rollout["refits"][2]


def test_preemption_mid_in_place_refit_says_the_live_weights_are_partial(tmp_path: Path) -> None:
    def preempt(procs: dict[str, Any]) -> None:
        os.kill(procs["rollout"].pid, signal.SIGTERM)

    job = SessionJob(mode="in_place", refits=2, pause_at=1)
    rollout = run_session_job(job, tmp_path, on_paused=preempt, expect=("rollout",))["rollout"]
    assert rollout["error_type"] == "Preempted", rollout
    assert rollout["weights_partial"] is True and rollout["live_weights_partial"] is True
    assert "live weights are partial: do not serve them" in rollout["error"]
    assert len(rollout["refits"]) == 1  # refit 0 committed, refit 1 stopped half-way
    live, old, new = rollout["live"], expected(0), expected(1)
    assert live != old and live != new, "the live tensors must hold a mix of both refits"
    assert any(live[n] == new[n] != old[n] for n in live), "some bytes of refit 1 landed"


def test_dead_policy_mid_in_place_refit_raises_partial_refit_error(tmp_path: Path) -> None:
    def kill_policy(procs: dict[str, Any]) -> None:
        os.kill(procs["policy"].pid, signal.SIGKILL)

    job = SessionJob(mode="in_place", refits=2, pause_at=1, timeout_s=3.0)
    rollout = run_session_job(job, tmp_path, on_paused=kill_policy, expect=("rollout",))["rollout"]
    assert rollout["error_type"] == "PartialRefitError", rollout
    assert "now mix two refits: do not serve them" in rollout["error"]
    assert "policy rank 0" in rollout["error"]  # says which peer it lost
    assert rollout["live_weights_partial"] is True


def test_dead_policy_mid_double_buffered_refit_leaves_the_served_copy_untouched(
    tmp_path: Path,
) -> None:
    def kill_policy(procs: dict[str, Any]) -> None:
        os.kill(procs["policy"].pid, signal.SIGKILL)

    job = SessionJob(mode="double_buffer", refits=2, pause_at=1, timeout_s=3.0)
    rollout = run_session_job(job, tmp_path, on_paused=kill_policy, expect=("rollout",))["rollout"]
    assert rollout["error_type"] in {"RefitTimeoutError", "PeerError"}, rollout
    assert rollout["live"] == expected(0), "the served copy must still be refit 0, whole"
    assert rollout["live_weights_partial"] is False


@pytest.mark.parametrize("mode", ["double_buffer", "in_place"])
def test_layout_mismatch_is_refused_before_any_byte_lands(tmp_path: Path, mode: str) -> None:
    job = SessionJob(mode=mode, refits=1, wrong_shape="embed.weight")
    reports = run_session_job(job, tmp_path)
    rollout, policy = reports["rollout"], reports["policy"]
    assert rollout["error_type"] == "LayoutMismatchError", rollout
    assert (
        "'embed.weight': sent bfloat16[257, 64], target has bfloat16[258, 64]" in (rollout["error"])
    )
    assert "nothing was written" in rollout["error"]
    assert rollout["live_weights_partial"] is False
    # The rollout's failure is not the policy's: the engine drops that target from the
    # refit (RefitTiming.dropped) instead of failing the send, and the session sends the
    # refit again while that rank stays listed (no coordinator drops it here); with no
    # member taking it within the timeout, the policy says it reached no one
    # (docs/failure-domains.md), not that the layout was wrong.
    assert policy["error_type"] == "RefitUndelivered", policy
    assert "refit 0 reached no rollout member" in policy["error"], policy


@pytest.mark.parametrize("mode", ["receive", "double_buffer"])
def test_delta_refits_land_bit_exact_and_a_corrupt_one_is_rejected(
    tmp_path: Path, mode: str
) -> None:
    """Issue #32: with ``transfer.delta: on`` and 2% of the elements changing per refit,
    refits after the first cross as deltas, applied onto a spare copy and checked whole
    before the commit.  Refit 3's delta has one flipped bit (the trainer's digest stays
    true): the replica rejects it while still serving refit 2, bit for bit, and takes
    refit 3 whole; the deltas go on after it."""
    job = SessionJob(mode=mode, refits=6, delta="on", changes=0.02, corrupt_at=3)
    reports = run_session_job(job, tmp_path)
    policy, rollout = reports["policy"], reports["rollout"]
    assert "error" not in rollout and "error" not in policy, (policy, rollout)
    assert rollout["refits"] == [sent_digests(job, k) for k in range(job.refits)]
    (rejected,) = rollout["rejected"]
    assert "the trainer's is" in rejected["error"], rejected
    assert rejected["committed"] == rejected["served"] == 2, rejected
    assert rejected["live"] == sent_digests(job, 2)  # what it served meanwhile: refit 2
    sent = [refit["bytes"] for refit in policy["refits"]]
    whole = sent[0]
    assert sent[3] == whole, sent  # the rejected delta's refit went again, whole
    assert all(0 < sent[k] < whole / 4 for k in (1, 2, 4, 5)), sent


def test_an_in_place_receiver_takes_delta_refits_whole(tmp_path: Path) -> None:
    """In place, a delta could not be checked before the weights serve: the receiver
    declines it and the policy sends that refit whole, every time."""
    job = SessionJob(mode="in_place", refits=3, delta="on", changes=0.02)
    reports = run_session_job(job, tmp_path)
    policy, rollout = reports["policy"], reports["rollout"]
    assert "error" not in rollout and "error" not in policy, (policy, rollout)
    assert rollout["refits"] == [sent_digests(job, k) for k in range(job.refits)]
    sent = [refit["bytes"] for refit in policy["refits"]]
    assert sent == [sent[0]] * job.refits, sent


@pytest.mark.parametrize("delta", ["", "on"], ids=["whole", "delta"])
def test_a_forged_refit_is_refused_and_the_last_signed_one_stays_served(
    tmp_path: Path, delta: str
) -> None:
    """Issue #50: the ranks hold the job's key; from refit 2 on a hostile process in the
    policy's place seals its sends with another key that names the job's (every hash
    matches its bytes).  The replica refuses refit 2 (a delta, with ``delta: on``) before
    it commits, names why, and still serves refit 1, bit for bit; refits 0 and 1 passed
    the job's key."""
    job = SessionJob(
        mode="double_buffer", refits=4, signed=True, forge_at=2, delta=delta, changes=0.02
    )
    reports = run_session_job(job, tmp_path)
    rollout = reports["rollout"]
    assert rollout["refits"] == [sent_digests(job, k) for k in range(2)], rollout
    assert "the signature does not verify with the job's key ed25519:" in rollout["error"]
    assert "not the trainer's refit" in rollout["error"] and "refit 2" in rollout["error"]
    assert rollout["live"] == sent_digests(job, 1)
    assert rollout["live_weights_partial"] is False
    assert rollout["signed_by"] == [SIGNED_BY, SIGNED_BY]
