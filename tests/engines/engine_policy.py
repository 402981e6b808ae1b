"""A policy rank for the engines tier: sends the tiny Llama's weights of each refit.

Run in the vLLM environment's Python (it needs transformers) as a subprocess of the test:

    python engine_policy.py   (settings in $REFIT_* and $ENGINE_POLICY, a JSON object)

For each pending refit ``k`` of its session the weights are those of a freshly initialised
tiny Llama with seed ``100 + k`` (so every refit changes every tensor, and the tokens);
HF ``generate`` on exactly those weights gives the expected greedy tokens for the fixed
prompts, which travel with the refit as the extra tensor ``expected_tokens`` (integrity
checked with the weights).  Each refit sent is reported as a JSON line on stdout.

The one test hook: ``pause_at`` makes the sender stall after the first bucket of that
refit (and say ``paused``), so a refit is reliably caught mid-transfer.

Real: RefitSession, NIXL (UCX), the file-backed rendezvous.  Nothing is emulated.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "rl-vllm"))

import tiny_llama

from refit_worker import RefitSession
from refit_worker.engine.messages.integrity import tensors_digest
from refit_worker.integrations.staged import EXTRA_PREFIX


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def stall_after_first_bucket() -> None:
    from refit_worker.engine.policy import refit_send as sender

    original = sender.RefitSender._send_bucket

    async def send_then_stall(self: Any, stream: Any, seq: int) -> None:
        await original(self, stream, seq)
        self.agent.flush()
        say(paused=seq)
        await asyncio.sleep(3600)

    sender.RefitSender._send_bucket = send_then_stall  # type: ignore[method-assign]


def weights_of(refit: int, dtype: str) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    model = tiny_llama.build_model(100 + refit, dtype)
    return dict(model.state_dict()), tiny_llama.hf_greedy(model)


def main() -> None:
    opts = json.loads(os.environ.get("ENGINE_POLICY", "{}"))
    dtype = opts.get("dtype", "float32")
    with RefitSession.from_env() as session:
        for refit in session.pending_refits:
            state, expected = weights_of(refit, dtype)
            items = [*state.items(), (EXTRA_PREFIX + "expected_tokens", torch.tensor(expected))]
            if refit == opts.get("pause_at", -1):
                stall_after_first_bucket()
            stats = asyncio.run(session.send(items, refit_id=refit))
            # What a replica serving this refit must report as its version (issue #32).
            digest = tensors_digest(dict(items))
            say(
                sent=refit,
                expected=expected,
                bytes=stats.bytes,
                seconds=stats.seconds,
                digest=digest,
            )


if __name__ == "__main__":
    main()
