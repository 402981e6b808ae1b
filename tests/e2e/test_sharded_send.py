"""Sharded trainers: FSDP2 and tensor-parallel policy ranks send their own shards, no gather.

Real: two policy processes in a real gloo group training a tiny HF Llama (FSDP2
``fully_shard``, or ``ColwiseParallel``/``RowwiseParallel``) with real optimizer steps, real
``RefitSession``s over the file rendezvous store, real NIXL (UCX) WRITEs, and rollout
processes receiving into plain HF models of their own (``receive_into(model)`` in place and
double-buffered, tied embeddings).  Counted on every policy rank during each ``send``: every
``torch.distributed`` collective call and every c10d / functional-collective op dispatched;
the gather-then-send refit of the first case shows the counter sees ``full_tensor()``'s
all-gathers.  The refusals of ``_StridedShard`` and ``Partial`` run in one real gloo rank
(no transfer).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.sharded_procs import ShardedJob, run_refusals, run_sharded_job


def _check_bit_exact(reports: dict, job: ShardedJob) -> None:
    for key, report in reports.items():
        assert "error" not in report, (key, report)
    want = reports[("policy", 0)]["refits"]
    assert reports[("policy", 1)]["refits"] == want  # both ranks' full weights agree
    assert len({str(refit) for refit in want}) == job.refits, "each step changed the weights"
    for r in range(job.rollouts):
        rollout = reports[("rollout", r)]
        assert rollout["refits"] == want, f"rollout rank {r} differs from the trainer's weights"
        assert rollout.get("tied", True) is True


#: The collectives of one refit's plan on each policy rank: rank 0's plan (its length, its
#: JSON bytes) and the verdict; small control messages, never weights.
GANG_PLAN = (
    "torch.distributed.broadcast",
    "torch.distributed.broadcast",
    "torch.distributed.all_gather",
)


@pytest.mark.parametrize(
    ("layout", "rollouts", "gather_at", "mode"),
    [("fsdp", 1, 1, "in_place"), ("fsdp", 2, -1, "double_buffer"), ("tp", 1, -1, "in_place")],
)
def test_sharded_send_is_bit_exact_with_no_collective(
    tmp_path: Path, layout: str, rollouts: int, gather_at: int, mode: str
) -> None:
    job = ShardedJob(layout=layout, rollouts=rollouts, refits=3, gather_at=gather_at, mode=mode)
    reports = run_sharded_job(job, tmp_path)
    _check_bit_exact(reports, job)
    placements = reports[("policy", 0)]["placements"]
    if layout == "fsdp":
        assert placements["model.embed_tokens.weight"] == ["Shard(0)"]  # 511: 256 + 255 rows
    else:
        assert placements["model.layers.0.self_attn.q_proj.weight"] == ["Shard(0)"]
        assert placements["model.layers.0.self_attn.o_proj.weight"] == ["Shard(1)"]
        assert "model.embed_tokens.weight" not in placements  # plain: sent by one rank
    model_bytes = reports[("policy", 0)]["model_bytes"]
    for refit in range(job.refits):
        counted = [reports[("policy", r)]["collectives"][refit] for r in range(job.policy)]
        sent = [reports[("policy", r)]["bytes"][refit] for r in range(job.policy)]
        if refit == gather_at:
            # The control: the counter sees full_tensor()'s all-gathers on every rank.
            weights = [[c for c in calls if c not in GANG_PLAN] for calls in counted]
            assert all(any("all_gather" in c for c in calls) for calls in weights), counted
            continue
        # Nothing over the weights: only the gang's plan of the refit (one membership
        # broadcast, one verdict gathered; docs/failure-domains.md, "One plan per refit").
        assert counted == [list(GANG_PLAN)] * job.policy, f"refit {refit}: collectives during send"
        assert sum(sent) == model_bytes * rollouts, "every byte once per rollout rank"
        assert all(n < model_bytes * rollouts for n in sent), "no rank sent everything"


#: A sharded delta's agreement before the plan: every rank's offer, its length then its
#: JSON bytes (the changed elements' entries and the blocks' hashes, never the weights).
DELTA_OFFERS = ("torch.distributed.all_gather", "torch.distributed.all_gather")


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_sharded_senders_send_deltas_of_their_own_blocks_bit_exact(
    tmp_path: Path, layout: str
) -> None:
    # Only the MLPs' down projections train: Shard(0) under FSDP2, Shard(1) under TP
    # (RowwiseParallel), about an eighth of the elements.
    job = ShardedJob(
        layout=layout, refits=5, mode="double_buffer", delta="on", train="mlp.down_proj"
    )
    reports = run_sharded_job(job, tmp_path)
    _check_bit_exact(reports, job)
    model_bytes = reports[("policy", 0)]["model_bytes"]
    for refit in range(job.refits):
        counted = [reports[("policy", r)]["collectives"][refit] for r in range(job.policy)]
        assert counted == [list(DELTA_OFFERS + GANG_PLAN)] * job.policy, f"refit {refit}"
        sent = sum(reports[("policy", r)]["bytes"][refit] for r in range(job.policy))
        if refit == 0:
            assert sent == model_bytes, "the first refit has no base: whole"
        else:
            assert 0 < sent < model_bytes / 3, f"refit {refit}: {sent} of {model_bytes} bytes"
            # Each rank wrote its own piece: both sent some of the changes.
            assert all(reports[("policy", r)]["bytes"][refit] for r in range(job.policy))


def test_unsupported_placements_are_refused_naming_the_parameter(tmp_path: Path) -> None:
    refusals = run_refusals(tmp_path)
    name = "'model.layers.0.self_attn.q_proj.weight'"
    assert "_StridedShard" in refusals["strided"] and name in refusals["strided"], refusals
    assert "shard_placement_fn" in refusals["strided"]
    assert "pending reduction" in refusals["partial"] and name in refusals["partial"], refusals
