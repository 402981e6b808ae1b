"""The LoRA RL example's trainer: one policy rank training a PEFT LoRA on the tiny Llama
with FSDP2 (gloo), refitting only the adapter to the vLLM rollout after every step.

Each rank of the policy gang runs this (``refit run examples/rl-vllm-lora/job.yaml``).  It
builds the same base the rollout serves (``tiny_llama.build_model(seed=0)``, saved once to
compute the base digest the refit's header carries), wraps it in a PEFT LoRA, shards the
PEFT model with FSDP2 (every decoder layer, then the root; the base is frozen, only the
LoRA A/B train), and for every pending refit:

1. takes one AdamW step on the adapter (each rank its own windows of the corpus);
2. on rank 0, computes HF + PEFT's greedy tokens and logprobs for the fixed prompts with
   exactly that adapter (the reference the rollout checks vLLM against); the adapter is
   gathered for this (``full_tensor``, a few KB), the base never is;
3. sends ``get_peft_model_state_dict(model)``, whose values under FSDP2 are the adapter's
   DTensor shards, with ``adapter=header``: each rank writes only its own shards.

Must not import: vLLM (the trainer never loads it).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

# The whole-model example's directory: the tiny Llama both sides build the base from, and
# its trainer's data windows and process (this file is named apart so they import).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "rl-vllm"))

import policy as whole_model
import tiny_llama

from refit_worker import RefitSession
from refit_worker.contract.adapters import AdapterHeader, checkpoint_digest
from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.exits import EXIT_FAILED
from refit_worker.integrations.staged import EXTRA_PREFIX

log = logging.getLogger("rl-vllm-lora.policy")
TARGETS = ("q_proj", "v_proj", "down_proj")
RANK, ALPHA = 4, 8.0
LR = 3e-2


def lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0)


def base_header(adapter: str) -> AdapterHeader:
    """The header every refit carries: the adapter's shape and the base's digest, taken
    from the checkpoint the rollout serves (same seed, same bytes)."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = tiny_llama.save_checkpoint(tiny_llama.build_model(seed=0), Path(tmp))
        digest = checkpoint_digest(directory)
    return AdapterHeader(
        name=adapter,
        rank=RANK,
        alpha=ALPHA,
        target_modules=TARGETS,
        base="tiny-llama-seed0",
        base_digest=digest,
    )


def sharded_peft(world: int) -> tuple[Any, torch.optim.Optimizer]:
    """The PEFT model sharded by FSDP2 over ``world`` CPU ranks, and AdamW on its LoRA."""
    from peft import get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)  # the LoRA A init: equal on every rank before sharding
    model = get_peft_model(tiny_llama.build_model(seed=0), lora_config())
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=LR)


def expected_outputs(state: dict[str, Any], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF + PEFT's greedy tokens and their logprobs for this adapter, on every rank."""
    from peft import get_peft_model, set_peft_model_state_dict

    # Every rank takes part in the adapter's gather (a collective); rank 0 uses it.
    full = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in state.items()}
    reference = None
    if rank == 0:
        reference = get_peft_model(tiny_llama.build_model(seed=0), lora_config())
        set_peft_model_state_dict(reference, full)
        reference.eval()
    return whole_model.broadcast_reference(reference)


def train_and_refit(config: WorkerConfig, session: RefitSession, header: AdapterHeader) -> None:
    from peft import get_peft_model_state_dict

    world, rank = config.policy_world_size, config.rank
    model, optimizer = sharded_peft(world)
    ids = tiny_llama.corpus_ids()
    for refit in session.pending_refits:
        batch = whole_model.batch_for(refit, rank, world, ids)
        model.train()
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        # PEFT's names, the FSDP2 DTensor shards as values: only the adapter, ungathered.
        state = get_peft_model_state_dict(model)
        tokens, logprobs = expected_outputs(state, rank)
        items = [
            *state.items(),
            (EXTRA_PREFIX + "expected_tokens", tokens),
            (EXTRA_PREFIX + "expected_logprobs", logprobs),
        ]
        stats = asyncio.run(session.send(items, refit_id=refit, adapter=header))
        log.info(
            "refit %d: loss %.4f, sent %d adapter bytes (%d tensors) in %.4f s",
            refit,
            float(loss.detach()),
            stats.bytes,
            len(state),
            stats.seconds,
        )


def main() -> int:
    config = WorkerConfig.from_env()
    adapter = config.transfer.adapter
    if adapter is None:
        raise SystemExit("this example needs spec.transfer.adapter (see job.yaml)")
    # Before the gang forms: transformers saves on the main rank only once a process
    # group is up, and every rank digests the base it saved.
    header = base_header(adapter.name or config.job)
    return int(whole_model.main(lambda cfg, session: train_and_refit(cfg, session, header)))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        log.exception("the trainer failed")
        sys.exit(EXIT_FAILED)
