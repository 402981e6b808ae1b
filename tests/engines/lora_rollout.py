"""The rollout of the engines tier's LoRA case: vLLM serving the tiny Llama with LoRA on,
each adapter refit a new adapter version.

Run in the vLLM environment's Python as a subprocess of the test, with $ENGINE_LORA (JSON:
``model_dir``, ``env``: the REFIT_* env of the session, ``refits``).  It saves the base
checkpoint, starts one vLLM engine (in-process, CPU, ``enable_lora``) and, for each refit,
lands it through the worker extension (:class:`VllmAdapterRefit`: loaded as
``<name>-v<k>`` and read back from vLLM's LoRA layers), generates greedily with that
version, compares tokens and logprobs with HF + PEFT's (the trainer's extras), commits it
(the default from then on), and asks for the version before it, which ``keep: 1``
unloaded.  Every step is a JSON line on stdout.  Real: vLLM, NIXL, peft on the trainer.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

from tests.engines import archs

from refit_worker.integrations.vllm import (
    WORKER_EXTENSION,
    AdapterVersionUnknown,
    VllmAdapterRefit,
)

tiny_llama = archs.tiny_llama
#: The largest logprob difference accepted between vLLM and HF + PEFT (float32 kernels).
LOGPROB_TOLERANCE = 1e-3


def say(step: str, **fields: Any) -> None:
    print(json.dumps({"step": step, **fields}), flush=True)


def one_refit(llm: Any, refit: VllmAdapterRefit, adapter: str, k: int) -> None:
    refit.begin(k)
    landed = refit.land()
    started = time.perf_counter()
    tokens, logprobs, served = tiny_llama.vllm_answers(llm, refit.request(landed["version"]))
    expected = landed["extras"]
    gap = archs.logprob_gap(logprobs, expected["expected_logprobs"])
    equal = tokens == expected["expected_tokens"] and gap <= LOGPROB_TOLERANCE
    if not equal:
        refit.reject(f"vLLM's tokens or logprobs differ from HF + PEFT's (gap {gap:.3g})")
    figures = refit.commit(time.perf_counter() - started) if equal else None
    after, _, default_served = tiny_llama.vllm_answers(llm, refit.request())
    older: dict[str, str] = {}
    for old in range(k):
        try:
            refit.request(f"{adapter}-v{old}")
            older[str(old)] = "served"
        except AdapterVersionUnknown as exc:
            older[str(old)] = str(exc)
    say(
        "refit",
        refit_id=k,
        version=landed["version"],
        served_by=served,
        tokens=tokens,
        expected_tokens=expected["expected_tokens"],
        logprob_gap=gap,
        probed=landed["probed"],
        figures=figures,
        default_after=default_served,
        tokens_after=after,
        loaded=list(refit.loaded),
        older=older,
    )


def main() -> None:
    opts = json.loads(os.environ["ENGINE_LORA"])
    model_dir = Path(opts["model_dir"])
    tiny_llama.save_checkpoint(tiny_llama.build_model(0, "float32"), model_dir)
    started = time.perf_counter()
    llm = tiny_llama.start_llm(
        model_dir,
        "float32",
        worker_extension_cls=WORKER_EXTENSION,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
    )
    base_tokens = tiny_llama.vllm_greedy(llm)
    say("started", seconds=time.perf_counter() - started, base_tokens=base_tokens)
    refit = VllmAdapterRefit(llm)
    try:
        refit.connect(opts["env"])
        for k in range(opts["refits"]):
            one_refit(llm, refit, opts["adapter"], k)
        refit.close()
    except Exception as exc:
        say("error", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
    finally:
        tiny_llama.shutdown_llm(llm)
    say("done")


if __name__ == "__main__":
    main()
