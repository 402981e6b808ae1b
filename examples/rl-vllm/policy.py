"""The RL example's trainer: one policy rank training a tiny Llama with FSDP2 on gloo.

Each rank of the policy gang runs this (``refit run examples/rl-vllm/job.yaml``, or a pod
of the same job on a cluster).  It joins the role's torch.distributed group (gloo) through
the rank-0 address the operator set in ``REFIT_MASTER_*``, shards a tiny Llama with FSDP2
(``fully_shard`` on every decoder layer and on the root), and for every pending refit:

1. takes one optimizer step (AdamW) on real tokens of the built-in text (each rank its own
   windows of it: data parallel);
2. on rank 0, computes HF ``generate``'s greedy tokens for the fixed prompts with exactly
   those weights (the reference of the check, from :func:`reference_weights`) and
   broadcasts them to every rank (a tensor, no pickle);
3. sends the FSDP2 parameters as they are, DTensors, plus those tokens (the extra tensor
   ``expected_tokens``) with ``RefitSession.send``: each rank writes only its own shards,
   with no gather; the rollout lands them in vLLM and checks vLLM's greedy tokens against
   them before it commits.

Preemption: the job's signal (or preemption notice) stops the send at a bucket boundary;
the rank exits with the preempted exit code and the recreated gang resumes at the next
refit (from freshly initialised weights: this example keeps no training checkpoint).

Must not import: vLLM (the trainer never loads it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_llama

from refit_worker import Preempted, RefitSession
from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.exits import EXIT_FAILED, EXIT_PREEMPTED
from refit_worker.integrations.staged import EXTRA_PREFIX, stop_flag
from refit_worker.pod.termination import write_termination_message

log = logging.getLogger("rl-vllm.policy")
SEQ_LEN = 16
BATCH = 4
LR = 1e-2


def reference_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter whole, by HF name, for the HF reference the rollout is checked
    against.  This gathers (``full_tensor()``), but only to compute the expected tokens:
    the refit itself sends the DTensors shard by shard (see :func:`train_and_refit`)."""
    out = []
    for name, param in model.named_parameters():
        data = param.detach()
        full = data.full_tensor() if hasattr(data, "full_tensor") else data
        out.append((name, full.contiguous()))
    return out


def batch_for(step: int, rank: int, world: int, ids: torch.Tensor) -> torch.Tensor:
    """``BATCH`` windows of ``SEQ_LEN + 1`` tokens: this rank's share of step ``step``."""
    starts = len(ids) - SEQ_LEN - 1
    picks = [((step * world + rank) * BATCH + i) * 7 % starts for i in range(BATCH)]
    return torch.stack([ids[s : s + SEQ_LEN + 1] for s in picks])


def expected_outputs(
    weights: list[tuple[str, torch.Tensor]], rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's HF greedy tokens for these weights and each token's logprob, on every
    rank."""
    reference = None
    if rank == 0:
        reference = tiny_llama.build_model(seed=0)
        reference.load_state_dict(dict(weights), strict=True)
    return broadcast_reference(reference)


def broadcast_reference(reference: torch.nn.Module | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy tokens and their logprobs of rank 0's ``reference`` model (None on the
    other ranks), on every rank (a tensor broadcast, no pickle)."""
    shape = (len(tiny_llama.PROMPTS), tiny_llama.NEW_TOKENS)
    tokens, logprobs = torch.zeros(shape, dtype=torch.int64), torch.zeros(shape)
    if reference is not None:
        greedy = tiny_llama.hf_greedy(reference)
        tokens = torch.tensor(greedy, dtype=torch.int64)
        logprobs = torch.tensor(tiny_llama.hf_logprobs(reference, greedy))
    dist.broadcast(tokens, src=0)
    dist.broadcast(logprobs, src=0)
    return tokens, logprobs


def shard(model: torch.nn.Module, world: int) -> torch.optim.Optimizer:
    """FSDP2 over ``world`` CPU ranks (each decoder layer, then the root); its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return torch.optim.AdamW(model.parameters(), lr=LR)


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor
) -> torch.Tensor:
    """One optimizer step on ``batch`` (next-token loss); the loss."""
    loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def train_and_refit(config: WorkerConfig, session: RefitSession) -> None:
    world, rank = config.policy_world_size, config.rank
    model = tiny_llama.build_model(seed=0).train()  # the rollout's checkpoint, too
    optimizer = shard(model, world)
    ids = tiny_llama.corpus_ids()
    for refit in session.pending_refits:
        loss = train_step(model, optimizer, batch_for(refit, rank, world, ids))
        tokens, logprobs = expected_outputs(reference_weights(model), rank)
        # DTensors as they are: this rank sends its own shards only; the plain tensors of
        # the expected outputs go along as extras.
        weights = [
            *model.named_parameters(),
            (EXTRA_PREFIX + "expected_tokens", tokens),
            (EXTRA_PREFIX + "expected_logprobs", logprobs),
        ]
        stats = asyncio.run(session.send(weights, refit_id=refit))
        log.info(
            "refit %d: loss %.4f, sent %d bytes in %.4f s; expected tokens %s",
            refit,
            float(loss.detach()),
            stats.bytes,
            stats.seconds,
            tokens.tolist(),
        )
        if rank == 0:  # the HF reference for this refit's weights, as one JSON line, for
            # whoever checks what a server answered with them (examples/rl-vllm-serve)
            expected = {"refit": refit, "tokens": tokens.tolist(), "logprobs": logprobs.tolist()}
            print(json.dumps({"expected": expected}), flush=True)


def join_gang(config: WorkerConfig) -> None:
    """Join the policy role's gloo group at the rank-0 address the operator set."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{config.master_addr}:{config.master_port}",
        rank=config.rank,
        world_size=config.policy_world_size,
        timeout=timedelta(seconds=config.transfer.timeout_seconds),
    )


def main(train: Callable[[WorkerConfig, RefitSession], None] = train_and_refit) -> int:
    """Join the gang and run ``train`` over the pending refits (the LoRA example passes
    its own, examples/rl-vllm-lora/lora_policy.py); the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = WorkerConfig.from_env()
    join_gang(config)
    try:
        with RefitSession(config, stop_requested=stop_flag(config)) as session:
            train(config, session)
    except Preempted as exc:
        log.info("preempted: %s", exc)
        return EXIT_PREEMPTED
    except Exception as exc:
        write_termination_message(f"{type(exc).__name__}: {exc}", config.termination_message_path)
        raise
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        logging.getLogger("rl-vllm.policy").exception("the trainer failed")
        sys.exit(EXIT_FAILED)
