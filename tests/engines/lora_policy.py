"""The trainer of the engines tier's LoRA case: a real PEFT LoRA on the tiny Llama, real
AdamW steps, each refit only the adapter.

Run in the vLLM environment's Python (it needs transformers and peft) as a subprocess of
the test, with the REFIT_* env of its session and $ENGINE_LORA (JSON: ``model_dir``, the
base checkpoint the rollout serves, and ``steps`` per refit).  The base is loaded from
that checkpoint (its digest goes in each refit's header); before each refit the adapter
takes ``steps`` AdamW steps on the tiny corpus, then HF + PEFT's greedy tokens and their
logprobs for the fixed prompts are the reference, sent along as the extras
``expected_tokens`` and ``expected_logprobs``.  Each refit sent is a JSON line on stdout.

Real: transformers, peft, torch's AdamW, RefitSession, NIXL (UCX), the file rendezvous.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import torch
from tests.engines import archs

from refit_worker import RefitSession
from refit_worker.contract.adapters import AdapterHeader, checkpoint_digest
from refit_worker.integrations.staged import EXTRA_PREFIX

TARGETS = ("q_proj", "v_proj", "down_proj")
RANK, ALPHA = 4, 8.0


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def peft_model(model_dir: str) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(7)
    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0)
    return get_peft_model(base, config)


def train(model: Any, optimizer: torch.optim.Optimizer, steps: int) -> float:
    """``steps`` AdamW steps of next-token loss on the tiny corpus; the last loss."""
    ids = archs.tiny_llama.corpus_ids()[None, :96]
    model.train()
    loss = torch.zeros(())
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return float(loss)


def main() -> None:
    from peft import get_peft_model_state_dict

    opts = json.loads(os.environ["ENGINE_LORA"])
    model = peft_model(opts["model_dir"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=opts.get("lr", 3e-2))
    header = AdapterHeader(
        name=opts["adapter"],
        rank=RANK,
        alpha=ALPHA,
        target_modules=TARGETS,
        base=opts["model_dir"],
        base_digest=opts.get("base_digest") or checkpoint_digest(opts["model_dir"]),
    )
    with RefitSession.from_env() as session:
        for refit in session.pending_refits:
            loss = train(model, optimizer, opts["steps"])
            tokens, logprobs = archs.hf_reference(model)
            state = get_peft_model_state_dict(model)
            items = [
                *state.items(),
                (EXTRA_PREFIX + "expected_tokens", torch.tensor(tokens)),
                (EXTRA_PREFIX + "expected_logprobs", torch.tensor(logprobs)),
            ]
            stats = asyncio.run(session.send(items, refit_id=refit, adapter=header))
            say(sent=refit, loss=loss, tokens=tokens, bytes=stats.bytes, seconds=stats.seconds)


if __name__ == "__main__":
    main()
