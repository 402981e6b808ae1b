"""The rollout side of the engines tier: one vLLM engine, three refit scenarios.

Run in the vLLM environment's Python as a subprocess of the test, with the settings in
$ENGINE_ROLLOUT (JSON: the model directory, the REFIT_* env of each epoch's session).  It
starts one vLLM engine (in-process, CPU) on a tiny Llama checkpoint and then:

1. **landed** (epoch 0, the worker extension): refit 0 streams in the background while
   the engine keeps generating; it is landed through vLLM's reload, vLLM's greedy tokens
   are compared with the trainer's (HF ``generate`` on the sent weights, carried as the
   refit's extra ``expected_tokens``), and it is committed as ``verified_as="tokens"``;
2. **preempted** (epoch 0): refit 1 starts, the trainer stalls after one bucket, the test
   sends this process a real SIGTERM (``os.kill``): the refit stops with ``Preempted``;
   the tokens generated during and after it are compared with refit 0's;
3. **next** (epoch 1, vLLM's weight-transfer registry, backend ``kube-refit``): a new
   session takes refit 1 through ``init_weight_transfer_engine`` / ``start_weight_update``
   / ``update_weights`` / ``finish_weight_update``, driven by ``VllmBackendRefit`` so that
   the prefix cache (the prompts share a prefix) is cleared before the new weights answer.

Every step is a JSON line on stdout (``{"step": ...}``); the engine is shut down
explicitly at the end.  Real: vLLM, NIXL, the signal.  Nothing is emulated.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "rl-vllm"))

import tiny_llama

from refit_worker.integrations.vllm import (
    BACKEND,
    WORKER_EXTENSION,
    VllmBackendRefit,
    VllmRefit,
    register_backend,
)


def say(step: str, **fields: Any) -> None:
    print(json.dumps({"step": step, **fields}), flush=True)


def generate_until_ready(llm: Any, refit: VllmRefit, limit_s: float) -> list[list[list[int]]]:
    """Generate while the refit streams in; every batch of tokens generated meanwhile."""
    batches = []
    deadline = time.monotonic() + limit_s
    while not refit.ready() and time.monotonic() < deadline:
        batches.append(tiny_llama.vllm_greedy(llm))
    return batches


def landed(llm: Any, refit: VllmRefit, env: dict[str, str]) -> None:
    refit.connect(env)
    refit.begin(0, verified_as="tokens")
    during = generate_until_ready(llm, refit, 60)
    landing = refit.land()
    started = time.perf_counter()
    tokens = tiny_llama.vllm_greedy(llm)
    equal = tokens == landing.extras["expected_tokens"]
    verify_s = time.perf_counter() - started
    if not equal:
        refit.reject("vLLM's greedy tokens differ from the trainer's")
        say("landed", error="tokens differ", tokens=tokens, landing=landing)
        return
    figures = refit.commit(verify_s)
    say(
        "landed",
        tokens=tokens,
        expected=landing.extras["expected_tokens"],
        during=during,
        figures=figures,
        landing_s=landing.landing_s,
    )


def preempted(llm: Any, refit: VllmRefit) -> None:
    before = tiny_llama.vllm_greedy(llm)
    refit.begin(1, verified_as="tokens")
    say("preempt-me", pid=os.getpid())
    during = generate_until_ready(llm, refit, 60)
    try:
        refit.land()
        outcome = {"error_type": None}
    except Exception as exc:
        outcome = {"error_type": type(exc).__name__, "error": str(exc)}
    after = tiny_llama.vllm_greedy(llm)
    refit.close()
    say("preempted", before=before, during=during, after=after, **outcome)


def next_refit(llm: Any, env: dict[str, str]) -> None:
    backend = VllmBackendRefit(llm)
    backend.init(env)
    version = backend.update(1)
    tokens = tiny_llama.vllm_greedy(llm)
    backend.close()
    say("next", tokens=tokens, version=version)


def main() -> None:
    opts = json.loads(os.environ["ENGINE_ROLLOUT"])
    model_dir = Path(opts["model_dir"])
    tiny_llama.save_checkpoint(tiny_llama.build_model(0, opts["dtype"]), model_dir)
    started = time.perf_counter()
    tiny_llama.vllm_env()
    # In-process engine: this process must know the backend before the engine starts (an
    # installed kube-refit does it through vLLM's plugin entry point instead).
    register_backend()
    llm = tiny_llama.start_llm(
        model_dir,
        opts["dtype"],
        worker_extension_cls=WORKER_EXTENSION,
        weight_transfer_config={"backend": BACKEND},
    )
    say("started", seconds=time.perf_counter() - started, tokens=tiny_llama.vllm_greedy(llm))
    refit = VllmRefit(llm)
    try:
        landed(llm, refit, opts["env"][0])
        preempted(llm, refit)
        next_refit(llm, opts["env"][1])
    except Exception as exc:
        say("error", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
    finally:
        tiny_llama.shutdown_llm(llm)
    say("done")


if __name__ == "__main__":
    main()
