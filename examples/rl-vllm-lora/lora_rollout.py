"""The LoRA RL example's rollout: vLLM serving the tiny Llama with LoRA on, every adapter
refit a new adapter version.

It writes the base checkpoint (the trainer's base, same seed), starts vLLM on it
(in-process, CPU, ``enable_lora``) with kube-refit's worker extension, and for every
pending refit:

1. receives the adapter in the background while generating with the current default;
2. lands it as ``<name>-v<refit>`` (refused before anything loads if its base digest is
   not the served checkpoint's) and reads its A/B back from vLLM's LoRA layers;
3. generates with that version and compares tokens and logprobs with HF + PEFT's (sent
   along by the trainer), then commits it (the default from now on; the version before it
   is unloaded, ``keep: 1``), or rejects it and fails the rank.

Must not import: the operator.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

# The whole-model example's directory: the tiny Llama, and its rollout's process (this
# file is named apart so it imports).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "rl-vllm"))

import rollout as whole_model
import tiny_llama

from refit_worker.integrations.vllm import VllmAdapterRefit

log = logging.getLogger("rl-vllm-lora.rollout")
#: The largest logprob difference accepted between vLLM and HF + PEFT (float32 kernels).
LOGPROB_TOLERANCE = 1e-3


class AnswersDiffer(RuntimeError):
    """vLLM with the new adapter does not answer what HF + PEFT answers with it."""


def refit_once(llm: Any, refit: VllmAdapterRefit, refit_id: int) -> None:
    refit.begin(refit_id, verified_as="tokens")
    served = 0
    while not refit.ready():  # the current default keeps serving while the adapter streams
        tiny_llama.vllm_answers(llm, refit.request() if refit.default else None)
        served += 1
    landed = refit.land()
    started = time.perf_counter()
    tokens, logprobs, _ = tiny_llama.vllm_answers(llm, refit.request(landed["version"]))
    want = landed["extras"]
    gap = max(
        abs(a - b)
        for got, exp in zip(logprobs, want["expected_logprobs"], strict=True)
        for a, b in zip(got, exp, strict=True)
    )
    if tokens != want["expected_tokens"] or gap > LOGPROB_TOLERANCE:
        refit.reject(f"vLLM's tokens or logprobs differ from HF + PEFT's (gap {gap:.3g})")
        raise AnswersDiffer(f"refit {refit_id}: vLLM {tokens}, HF + PEFT {want['expected_tokens']}")
    figures = refit.commit(time.perf_counter() - started)
    log.info(
        "refit %d: %s serves HF + PEFT's greedy tokens (logprob gap %.2g), %d LoRA modules "
        "read back; transfer %.4f s, landing %.4f s, verification %.4f s; loaded %s; %d "
        "generations served while it streamed in",
        refit_id,
        landed["version"],
        gap,
        len(landed["probed"]),
        figures["transfer_s"],
        figures["landing_s"],
        figures["verify_s"],
        figures["loaded"],
        served,
    )


if __name__ == "__main__":
    # keep (1) + the version checked before its commit: vLLM must hold 2 adapters.
    lora = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
    sys.exit(whole_model.main(VllmAdapterRefit, refit_once, **lora))
