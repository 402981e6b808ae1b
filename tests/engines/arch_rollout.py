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
  ``update_weights`` / ``finish_weight_update`` (nothing but the backend's own read-back
  is claimed); the tokens and logprobs are reported for the test to compare with the
  trainer's.

A refit the landing refuses (``LandingError``) or whose tokens differ is reported as
``{"step": "rejected"}`` and the process exits 1, as a rollout rank must (it then does
not serve a mixed model; the operator replaces it).  Real: vLLM, NIXL, the rendezvous.
"""

from __future__ import annotations

import json
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
from refit_worker.integrations.vllm import BACKEND, LandingError, VllmRefit, register_backend

LOGPROB_ATOL = 1e-3


def say(step: str, **fields: Any) -> None:
    print(json.dumps({"step": step, **fields}), flush=True)


def check(llm: Any, extras: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """Why vLLM's tokens or logprobs differ from the trainer's (None: they agree)."""
    tokens, logprobs = archs.vllm_reference(llm)
    expected = extras["expected_logprobs"]
    gap = archs.logprob_gap(logprobs, expected)
    seen = {"tokens": tokens, "logprob_gap": gap}
    if tokens != extras["expected_tokens"]:
        return f"vLLM's greedy tokens {tokens} differ from HF's", seen
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
        try:
            landing = refit.land()
        except LandingError as exc:
            say("rejected", refit=refit_id, error=str(exc))
            raise SystemExit(1) from exc
        started = time.perf_counter()
        problem, seen = check(llm, landing["extras"])
        if problem is not None:
            refit.reject(problem)
            say("rejected", refit=refit_id, error=problem, **seen)
            raise SystemExit(1)
        figures = refit.commit(time.perf_counter() - started)
        read_back = {k: landing[k] for k in ("probed", "unprobed", "reloaded")}
        say("refit", refit=refit_id, figures=figures, **read_back, **seen)
    refit.close()


def by_backend(llm: Any, env: dict[str, str], refits: int) -> None:
    llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {"env": env}})
    for refit_id in range(refits):
        llm.collective_rpc("start_weight_update")
        try:
            llm.collective_rpc("update_weights", kwargs={"update_info": {"refit_id": refit_id}})
        except Exception as exc:
            say("rejected", refit=refit_id, error=f"{type(exc).__name__}: {exc}")
            raise SystemExit(1) from exc
        llm.collective_rpc("finish_weight_update")
        tokens, logprobs = archs.vllm_reference(llm)
        say("refit", refit=refit_id, tokens=tokens, logprobs=logprobs)
    llm.collective_rpc("shutdown_weight_transfer_engine")


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
    llm = tiny_llama.start_llm(model_dir, worker_extension_cls=opts["extension"], **backend)
    tokens, _ = archs.vllm_reference(llm)
    say("started", seconds=time.perf_counter() - started, tokens=tokens)
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
