"""What crosses the wire per vLLM worker at tensor parallelism 1 and 2, in ONE run.

The same Llama (``vllm_landing.py``'s, float32) is served twice one after the other by
vLLM's CPU build: with ``tensor_parallel_size=1``, then 2 (the ``mp`` executor, one
worker process per rank).  One policy process sends it refits over NIXL (UCX) with
``RefitSession.send``; each vLLM worker is a rollout rank that declares its part of every
tensor from vLLM's own layers and receives only that (``worker_part``).  Per refit and
worker the rollout reports the session's bytes and seconds (transfer, landing, read-back).

Printed: the medians over ``--runs`` refits (after ``--warmup``) of the bytes per worker,
the slowest worker's transfer / landing / check, the refit's wall time (begin to every
worker committed), and the ratios TP=2 / TP=1 measured in this run: of the bytes per
worker, and of the bytes per worker of the split tensors alone (without the norms, which
every worker receives whole).  The load average is printed with the figures.

Usage: ``python bench/vllm_tp.py [--runs 3] [--warmup 1] [--layers 8] [--json]``; the
engine side runs in the vLLM environment (``tests/engines/install.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "worker"))
sys.path.insert(0, str(ROOT / "examples" / "rl-vllm"))
sys.path.insert(0, str(ROOT / "bench"))

import vllm_landing  # noqa: E402  # the same model and policy side


def rollout(opts: dict[str, Any]) -> None:
    import tiny_llama

    from refit_worker.integrations.vllm import WORKER_EXTENSION, VllmRefit

    model_dir = Path(opts["dir"]) / "model"
    tiny_llama.save_checkpoint(tiny_llama.build_model(0, **vllm_landing._size(opts)), model_dir)
    parallel = {"tensor_parallel_size": opts["tp"]}
    if opts["tp"] > 1:
        parallel["distributed_executor_backend"] = "mp"  # type: ignore[assignment]
    llm = tiny_llama.start_llm(model_dir, worker_extension_cls=WORKER_EXTENSION, **parallel)
    refit = VllmRefit(llm)
    figures = []
    try:
        refit.connect()
        for refit_id in refit.pending():
            started = time.perf_counter()
            refit.begin(refit_id)
            refit.land()
            committed = refit.commit()
            figures.append({**committed, "wall_s": time.perf_counter() - started})
        refit.close()
    finally:
        tiny_llama.shutdown_llm(llm)
    print(json.dumps({"figures": figures}), flush=True)


def _env(store: Path, role: str, refits: int, bucket: int, tp: int) -> dict[str, str]:
    from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig

    return WorkerConfig(
        job=f"tp-bench-{tp}",
        role=role,  # type: ignore[arg-type]
        rank=0,  # a rollout worker adds its tensor-parallel rank
        policy_world_size=1,
        rollout_world_size=tp,
        pod_uid=str(uuid.uuid4()),
        transfer=TransferConfig(bucket_size=bucket, timeout_seconds=600, refits=refits),
        rendezvous=RendezvousConfig(store="file", location=str(store)),
        termination_message_path=str(store.parent / f"{role}.termination"),
    ).to_env()


def run_case(python: Path, args: argparse.Namespace, tp: int) -> list[dict[str, Any]]:
    """One engine at ``tp``: the timed refits' figures (each with every worker's)."""
    refits = args.warmup + args.runs
    opts: dict[str, Any] = {k: getattr(args, k) for k in ("hidden", "intermediate", "layers")}
    opts["vocab"], opts["tp"] = args.vocab, tp
    scripts = {"rollout": __file__, "policy": vllm_landing.__file__}
    with tempfile.TemporaryDirectory(prefix=f"vllm-tp{tp}-") as tmp:
        opts["dir"] = tmp
        envs = {r: _env(Path(tmp) / "rdzv", r, refits, args.bucket_mib << 20, tp) for r in scripts}
        figures = vllm_landing.run_pair(python, opts, envs, scripts, Path(tmp), rollouts=tp)
    return figures[args.warmup :]


def summary(figures: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over the refits: bytes per worker (the largest), the slowest worker's
    transfer, landing and check, and the wall time."""

    def med(pick: Any) -> float:
        return float(statistics.median(pick(f) for f in figures))

    return {
        "bytes": med(lambda f: max(w["bytes"] for w in f["workers"])),
        "transfer_s": med(lambda f: max(w["transfer_s"] for w in f["workers"])),
        "landing_s": med(lambda f: max(w["landing_s"] for w in f["workers"])),
        "check_s": med(lambda f: max(w["verify_s"] for w in f["workers"])),
        "wall_s": med(lambda f: f["wall_s"]),
    }


def whole_bytes(args: argparse.Namespace) -> int:
    """Bytes of the tensors every worker receives whole: the norms (float32)."""
    return 4 * args.hidden * (2 * args.layers + 1)


def drive(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        python = vllm_landing.engine_python()
    except RuntimeError as exc:
        print(f"vllm_tp: {exc}")
        return 1
    cases = {tp: summary(run_case(python, args, tp)) for tp in (1, 2)}
    whole = whole_bytes(args)
    one, two = cases[1], cases[2]
    ratios = {
        "bytes_per_worker_tp2_over_tp1": two["bytes"] / one["bytes"],
        "split_bytes_per_worker_tp2_over_tp1": (two["bytes"] - whole) / (one["bytes"] - whole),
        "wall_tp2_over_tp1": two["wall_s"] / one["wall_s"],
    }
    load = os.getloadavg()[0]
    print(
        f"vLLM TP=1 vs TP=2, the same Llama ({args.layers} layers, hidden {args.hidden}, "
        f"vocabulary {args.vocab}, float32); medians of {args.runs} refits after "
        f"{args.warmup} warm-up; load average {load:.1f}; {time.monotonic() - started:.0f} s"
    )
    print(
        f"  {'tp':>3}  {'MB/worker':>9}  {'transfer s':>10}  {'landing s':>9}"
        f"  {'check s':>8}  {'wall s':>7}"
    )
    for tp, c in cases.items():
        print(
            f"  {tp:>3}  {c['bytes'] / 1e6:>9.2f}  {c['transfer_s']:>10.4f}  "
            f"{c['landing_s']:>9.4f}  {c['check_s']:>8.4f}  {c['wall_s']:>7.3f}"
        )
    print("  " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    if args.json:
        print(json.dumps({"case": "vllm-tp", "load": load, "tp": cases, **ratios}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = vllm_landing.arguments(__doc__, ("rollout",))
    args = parser.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        parser.error("--runs must be >= 1 and --warmup >= 0")
    if args.role is not None:
        rollout(json.loads(os.environ["BENCH_OPTS"]))
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
