"""The RL example's rollout: vLLM serving the tiny Llama, refitted after every step.

Each rollout rank runs this in the vLLM environment.  It writes the trainer's initial
checkpoint (same seed, so both sides start equal), starts vLLM on it (in-process, CPU)
with kube-refit's worker extension, and for every pending refit:

1. begins receiving it in the background and keeps generating meanwhile (a rollout's
   work goes on while the weights stream in);
2. lands it through vLLM's own loader once it arrived whole and passed its integrity
   check (the only pause in generation);
3. checks that vLLM's greedy tokens for the fixed prompts equal the trainer's (HF
   ``generate`` on that step's weights, sent along as ``expected_tokens``), then commits
   it as ``verified_as="tokens"``, or rejects it and fails the rank.

Every refit's transfer, landing and verification seconds go to the rank's progress report
(and so to the job's status) and to this log.

Must not import: the operator.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_llama

from refit_worker import Preempted
from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.exits import EXIT_PREEMPTED
from refit_worker.contract.failures import exit_code_for
from refit_worker.integrations.vllm import WORKER_EXTENSION, VllmRefit
from refit_worker.pod.termination import write_termination_message

log = logging.getLogger("rl-vllm.rollout")


class TokensDiffer(RuntimeError):
    """vLLM's greedy tokens after a refit are not the trainer's for the same weights."""


def refit_once(llm: Any, refit: VllmRefit, refit_id: int) -> None:
    refit.begin(refit_id, verified_as="tokens")
    served = 0
    while not refit.ready():  # generation goes on while the refit is awaited and streams in
        tiny_llama.vllm_greedy(llm)
        served += 1
    landing = refit.land()
    started = time.perf_counter()
    tokens = tiny_llama.vllm_greedy(llm)
    expected = landing.extras["expected_tokens"]
    verify_s = time.perf_counter() - started
    if tokens != expected:
        refit.reject("vLLM's greedy tokens differ from the trainer's")
        raise TokensDiffer(f"refit {refit_id}: vLLM generated {tokens}, HF {expected}")
    figures = refit.commit(verify_s)
    log.info(
        "refit %d: vLLM's greedy tokens equal HF generate's (%d prompts x %d tokens); "
        "transfer %.4f s, landing %.4f s, verification %.4f s; %d generations served "
        "while it was awaited and streamed in",
        refit_id,
        len(tokens),
        tiny_llama.NEW_TOKENS,
        figures["transfer_s"],
        figures["landing_s"],
        figures["verify_s"],
        served,
    )


def main(
    driver: Callable[[Any], VllmRefit] = VllmRefit,
    step: Callable[[Any, Any, int], None] = refit_once,
    **engine: Any,
) -> int:
    """Serve the tiny Llama and take every pending refit with ``step``; the exit code.
    The LoRA example (examples/rl-vllm-lora/lora_rollout.py) passes its adapter driver, its
    step and vLLM's LoRA arguments (``engine``)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = WorkerConfig.from_env()
    model_dir = tiny_llama.save_checkpoint(tiny_llama.build_model(seed=0), Path("model"))
    llm = tiny_llama.start_llm(model_dir, worker_extension_cls=WORKER_EXTENSION, **engine)
    refit = driver(llm)
    try:
        refit.connect()
        for refit_id in refit.pending():
            step(llm, refit, refit_id)
        refit.close()
    except Preempted as exc:
        log.info("preempted: %s", exc)
        return EXIT_PREEMPTED
    except Exception as exc:
        write_termination_message(f"{type(exc).__name__}: {exc}", config.termination_message_path)
        log.exception("the rollout failed")
        # A refit the served model cannot take (LayoutRefused) fails the job at once: a
        # replacement would meet the same names; anything else is replaced.
        return exit_code_for(exc)
    finally:
        tiny_llama.shutdown_llm(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
