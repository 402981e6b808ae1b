"""A policy rank of the architecture matrix: FSDP2 training of one tiny model, refitted.

Run in the vLLM environment's Python, one process per policy rank (two in the tier), with
the rank's ``REFIT_*`` env and ``$ENGINE_TRAINER`` (JSON: ``arch``; ``per_expert_at``: the
refits whose fused expert tensors are sent by the checkpoint's per-expert names, gathered
whole, instead of as the trainer holds them).  Each rank joins a gloo group, shards the
model with FSDP2 (``fully_shard`` per decoder layer and on the root), and per refit:

1. one AdamW step on its own windows of the built-in text (data parallel, real loss);
2. rank 0 computes the ground truth on exactly those weights (gathered): HF ``generate``'s
   greedy tokens and each token's logprob, broadcast as tensors (no pickle);
3. sends the FSDP2 parameters as they are (DTensors, each rank its shards) plus the ground
   truth (extras ``expected_tokens``, ``expected_logprobs``).

Every refit is a JSON line on stdout: ``{"refit": k, "loss": ..., "fixed_loss": ...
(after the step, on one fixed batch, so that refits compare), "tokens": ...,
"logprobs": ...}`` (the ground truth, for the test to compare the backend path with).
Real: FSDP2, gloo, RefitSession, NIXL (UCX), the file-backed rendezvous.  Nothing is emulated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tests.engines import archs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "rl-vllm"))

import tiny_llama
from policy import batch_for, join_gang, reference_weights, shard, train_step

from refit_worker import RefitSession
from refit_worker.contract.config import WorkerConfig
from refit_worker.integrations.hf_names import checkpoint_model_type, to_checkpoint_names
from refit_worker.integrations.staged import EXTRA_PREFIX
from refit_worker.integrations.vllm import checkpoint_layout


def ground_truth(
    arch: str, weights: dict[str, torch.Tensor], rank: int, fixed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Rank 0's HF tokens and logprobs for ``weights``, and their loss on the ``fixed``
    batch (so that refits compare; on the plain HF model, outside FSDP), on every rank."""
    shape = (len(tiny_llama.PROMPTS), tiny_llama.NEW_TOKENS)
    tokens, logprobs = torch.zeros(shape, dtype=torch.int64), torch.zeros(shape)
    loss = torch.zeros(())
    if rank == 0:
        reference = archs.build_model(arch, seed=0)
        # A tied head is one parameter with the embedding: named_parameters() lists it once.
        missing, unexpected = reference.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if reference.config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"reference weights: missing {missing}, unexpected {unexpected}")
        got_tokens, got_logprobs = archs.hf_reference(reference)
        tokens, logprobs = torch.tensor(got_tokens), torch.tensor(got_logprobs)
        with torch.no_grad():
            loss = reference(input_ids=fixed[:, :-1], labels=fixed[:, :-1]).loss.float()
    for tensor in (tokens, logprobs, loss):
        dist.broadcast(tensor, src=0)
    return tokens, logprobs, float(loss)


def train(config: WorkerConfig, session: RefitSession, opts: dict[str, Any]) -> None:
    world, rank, arch = config.policy_world_size, config.rank, opts["arch"]
    model = archs.build_model(arch, seed=0).train()  # the rollout's checkpoint, too
    train_only = opts.get("train_only")
    for name, param in model.named_parameters():
        # Partial fine-tuning: the frozen tensors never change, so a delta leaves them out.
        if train_only and not name.startswith(tuple(train_only)):
            param.requires_grad_(False)
    optimizer = shard(model, world)
    ids = tiny_llama.corpus_ids()
    served = checkpoint_layout(opts["model_dir"])
    model_type = checkpoint_model_type(opts["model_dir"])
    for refit in session.pending_refits:
        loss = train_step(model, optimizer, batch_for(refit, rank, world, ids))
        full = dict(reference_weights(model))
        tokens, logprobs, held_out = ground_truth(arch, full, rank, batch_for(0, 0, 1, ids))
        if refit in opts.get("per_expert_at", []):
            weights = list(to_checkpoint_names(full, served, model_type=model_type).items())
        else:
            weights = list(model.named_parameters())
        # A trainer whose names the served model does not know (a deliberate mismatch).
        renamed = opts.get("rename") or {}
        weights = [(renamed.get(n, n), t) for n, t in weights]
        extras = [(EXTRA_PREFIX + "expected_tokens", tokens)]
        extras.append((EXTRA_PREFIX + "expected_logprobs", logprobs))
        asyncio.run(session.send([*weights, *extras], refit_id=refit))
        truth = {"tokens": tokens.tolist(), "logprobs": logprobs.tolist()}
        print(
            json.dumps(
                {"refit": refit, "loss": float(loss.detach()), "fixed_loss": held_out, **truth}
            ),
            flush=True,
        )


def main() -> None:
    opts = json.loads(os.environ["ENGINE_TRAINER"])
    # The worker's own lines (whole or delta, and why) in policy-N.log, beside the JSON.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    config = WorkerConfig.from_env()
    join_gang(config)
    try:
        with RefitSession(config) as session:
            train(config, session, opts)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
