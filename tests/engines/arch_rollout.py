"""The rollout of the architecture matrix: one vLLM engine, every refit checked.

Run in the vLLM environment's Python with ``$ENGINE_ROLLOUT`` (JSON: ``arch``,
``model_dir``, ``env`` (the rank's ``REFIT_*``), ``path``: ``"extension"`` or
``"backend"``, ``extension``: the worker extension's qualified name, ``claim``).  It
saves the trainer's initial checkpoint (seed 0), starts vLLM (in-process, CPU) on it
once, and takes every pending refit:

- ``extension``: ``VllmRefit`` begin / land / commit; after the landing (where kube-refit
  reads every served layer back), vLLM's greedy tokens and their logprobs are compared
  here with the trainer's ground truth (the refit's extras); committed claiming
  ``claim`` (default ``tokens``; null: only what the landing's own read-back reached);
- ``backend``: vLLM's own ``init_weight_transfer_engine`` / ``start_weight_update`` /
  ``update_weights`` / ``finish_weight_update``, made by ``VllmBackendRefit`` (nothing but
  the backend's own read-back is claimed); the tokens and logprobs are reported for the
  test to compare with the trainer's.

After every commit the rollout generates again (``after``): the tokens, logprobs and
weight versions a client then gets.  Prefix caching is on and the prompts share a
72-token prefix (``tiny_llama.PROMPTS``), so a KV block cached from older weights would
show in those tokens.

A refit the landing refuses (``LandingError``) or whose tokens differ is reported as
``{"step": "rejected"}`` and the process exits 1, as a rollout rank must (it then does
not serve a mixed model; the operator replaces it).  Real: vLLM, NIXL, the rendezvous.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tests.engines import archs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "rl-vllm"))

import tiny_llama

from refit_worker.contract.entries import Verification
from refit_worker.contract.failures import exit_code_for
from refit_worker.integrations.vllm import (
    BACKEND,
    LandingError,
    VllmBackendRefit,
    VllmRefit,
    checkpoint_layout,
    register_backend,
    weight_versions,
)

LOGPROB_ATOL = 1e-3


def say(step: str, **fields: Any) -> None:
    print(json.dumps({"step": step, **fields}), flush=True)


def generate(llm: Any) -> dict[str, Any]:
    """vLLM's greedy tokens, their logprobs, and the weight versions that produced them."""
    tokens, logprobs, outputs = archs.vllm_reference(llm)
    return {"tokens": tokens, "logprobs": logprobs, "versions": weight_versions(outputs[0])}


def check(llm: Any, extras: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """Why vLLM's tokens or logprobs differ from the trainer's (None: they agree)."""
    seen = generate(llm)
    gap = archs.logprob_gap(seen.pop("logprobs"), extras["expected_logprobs"])
    seen["logprob_gap"] = gap
    if seen["tokens"] != extras["expected_tokens"]:
        return f"vLLM's greedy tokens {seen['tokens']} differ from HF's", seen
    if gap > LOGPROB_ATOL:
        return f"vLLM's logprobs differ from HF's by up to {gap:.3g}", seen
    return None, seen


def by_extension(llm: Any, env: dict[str, str], claim: Verification | None) -> None:
    refit = VllmRefit(llm)
    refit.connect(env)
    for refit_id in refit.pending():
        refit.begin(refit_id, verified_as=claim)
        while not refit.ready():
            time.sleep(0.05)
        staged_at = time.monotonic()
        try:
            landing = refit.land()
        except LandingError as exc:
            after = time.monotonic() - staged_at
            say("rejected", refit=refit_id, error=str(exc), refused_after_s=after)
            # A layout no replacement can cure exits not-retryable: the job fails at once.
            raise SystemExit(exit_code_for(exc)) from exc
        started = time.perf_counter()
        problem, seen = check(llm, landing.extras)
        if problem is not None:
            refit.reject(problem)
            say("rejected", refit=refit_id, error=problem, **seen)
            raise SystemExit(1)
        figures = refit.commit(time.perf_counter() - started)
        # After the commit: what a client now gets, and the version it is tagged with.
        after = generate(llm)
        read_back = {
            "probed": list(landing.probed),
            "unprobed": list(landing.unprobed),
            "reloaded": list(landing.reloaded),
        }
        say("refit", refit=refit_id, figures=figures, after=after, **read_back, **seen)
    refit.close()


def by_backend(llm: Any, env: dict[str, str], refits: int) -> None:
    """vLLM's own weight-transfer calls, made by kube-refit's driver for the backend (the
    caches cleared, the weight version set at the commit)."""
    backend = VllmBackendRefit(llm)
    backend.init(env)
    for refit_id in range(refits):
        try:
            version = backend.update(refit_id)
        except Exception as exc:
            say("rejected", refit=refit_id, error=f"{type(exc).__name__}: {exc}")
            raise SystemExit(1) from exc
        say("refit", refit=refit_id, version=version, after=generate(llm))
    backend.close()


def checkpoint_bytes(model_dir: Path) -> dict[str, int]:
    """The checkpoint's bytes, and those of the tensors every worker holds whole (norms,
    the MoE routers)."""
    layout = checkpoint_layout(model_dir) or {}
    size = {n: 4 * math.prod(shape) for n, shape in layout.items()}  # float32
    whole = [
        n for n in size if "norm" in n or n.endswith(("mlp.gate.weight", "expert_gate.weight"))
    ]
    return {
        "model_bytes": sum(size.values()),
        "whole_bytes": sum(size[n] for n in whole),
    }


def main() -> None:
    opts = json.loads(os.environ["ENGINE_ROLLOUT"])
    model_dir = Path(opts["model_dir"])
    tiny_llama.save_checkpoint(archs.build_model(opts["arch"], 0), model_dir)
    tiny_llama.vllm_env()
    register_backend()
    started = time.perf_counter()
    # The backend only where it is used: a multiprocess engine's workers find it only
    # through the plugin entry point of an installed kube-refit (not this checkout's).
    backend = {"weight_transfer_config": {"backend": BACKEND}} if opts["path"] == "backend" else {}
    # Tensor parallelism: one vLLM worker process per rank ("mp"), each a rollout rank.
    tp = int(opts.get("tp", 1))
    if tp > 1:
        backend |= {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}
    llm = tiny_llama.start_llm(model_dir, worker_extension_cls=opts["extension"], **backend)
    # The first requests fill the prefix cache with KV blocks of the initial weights.
    tokens, _, _ = archs.vllm_reference(llm)
    say(
        "started",
        seconds=time.perf_counter() - started,
        tokens=tokens,
        **checkpoint_bytes(model_dir),
    )
    try:
        if opts["path"] == "extension":
            by_extension(llm, opts["env"], opts.get("claim", "tokens"))
        else:
            by_backend(llm, opts["env"], opts["refits"])
    except Exception as exc:
        say("error", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        raise SystemExit(1) from exc
    finally:
        tiny_llama.shutdown_llm(llm)
    say("done")


if __name__ == "__main__":
    sys.exit(main())
