"""vLLM landing cost against the transfer, in ONE run: what a refit costs beyond the wire.

A policy process sends refits of a Llama (default ~31 M parameters, float32, ~125 MB) over
NIXL (UCX) with ``RefitSession.send``; a rollout process serves the same architecture with
vLLM's CPU build and takes each refit through kube-refit's worker extension: received in
the background into registered staging memory (integrity hashes on), then landed with
vLLM's ``reload_weights`` (HF names; vLLM fuses qkv/gate_up and repacks for its CPU
kernels).  Per refit the rollout reports:

* ``transfer``: the session's own figure (first byte possible to every byte arrived and
  verified, plus the commit), the baseline;
* ``landing``: the one ``reload_weights`` call plus the redo of the one-time post-load
  processing it leaves stale (``vllm_served.redo_processing``);
* ``check``: the read-back of every served layer through vLLM's kernels
  (``vllm_served.check_served``, counted as verification in the rank's report).

Generation is held during the landing and the check.  Printed: every timed refit, the
medians of ``--runs`` refits (after ``--warmup``), and the ratios landing / transfer and
check / transfer of the medians, all measured in this run (the load average is printed:
other processes on the machine skew all three alike).

Usage: ``python bench/vllm_landing.py [--runs 3] [--warmup 1] [--json]`` from any Python
of the project; the engine sides run in the vLLM environment (``tests/engines/install.sh``,
made or reused first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "worker"))
sys.path.insert(0, str(ROOT / "examples" / "rl-vllm"))


def _size(opts: dict[str, Any]) -> dict[str, int]:
    return {
        "hidden_size": opts["hidden"],
        "intermediate_size": opts["intermediate"],
        "num_hidden_layers": opts["layers"],
        "num_attention_heads": opts["hidden"] // 32,
        "num_key_value_heads": max(1, opts["hidden"] // 128),
        "vocab_size": opts["vocab"],
    }


def policy(opts: dict[str, Any]) -> None:
    import tiny_llama
    import torch

    from refit_worker import RefitSession

    model = tiny_llama.build_model(0, **_size(opts))
    state = dict(model.state_dict())
    with RefitSession.from_env() as session:
        for refit in session.pending_refits:
            with torch.no_grad():
                for tensor in state.values():
                    tensor.add_(1e-3)  # every refit carries new values
            asyncio.run(session.send(state.items(), refit_id=refit))


def rollout(opts: dict[str, Any]) -> None:
    import tiny_llama

    from refit_worker.integrations.vllm import WORKER_EXTENSION, VllmRefit

    model_dir = Path(opts["dir"]) / "model"
    tiny_llama.save_checkpoint(tiny_llama.build_model(0, **_size(opts)), model_dir)
    llm = tiny_llama.start_llm(model_dir, worker_extension_cls=WORKER_EXTENSION)
    refit = VllmRefit(llm)
    figures = []
    try:
        refit.connect()
        for refit_id in refit.pending():
            refit.begin(refit_id)
            refit.land()
            figures.append(refit.commit())
        refit.close()
    finally:
        tiny_llama.shutdown_llm(llm)
    print(json.dumps({"figures": figures}), flush=True)


def _env(store: Path, role: str, refits: int, bucket: int) -> dict[str, str]:
    from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig

    return WorkerConfig(
        job="landing-bench",
        role=role,  # type: ignore[arg-type]
        rank=0,
        policy_world_size=1,
        rollout_world_size=1,
        pod_uid=str(uuid.uuid4()),
        transfer=TransferConfig(bucket_size=bucket, timeout_seconds=600, refits=refits),
        rendezvous=RendezvousConfig(store="file", location=str(store)),
        termination_message_path=str(store.parent / f"{role}.termination"),
    ).to_env()


def engine_python() -> Path:
    """The vLLM environment's Python (made or reused by ``tests/engines/install.sh``)."""
    venv = subprocess.run(
        ["bash", str(ROOT / "tests" / "engines" / "install.sh")],
        capture_output=True,
        text=True,
        check=False,
    )
    if venv.returncode != 0:
        raise RuntimeError(f"the vLLM environment failed to install:\n{venv.stderr}")
    return Path(venv.stdout.strip().splitlines()[-1]) / "bin" / "python"


def run_pair(
    python: Path,
    opts: dict[str, Any],
    envs: dict[str, dict[str, str]],
    scripts: dict[str, str],
    tmp: Path,
    rollouts: int = 1,
) -> list[dict[str, Any]]:
    """Start the rollout and the policy (``scripts``, ``--role``), open the barrier, and
    return the figures the rollout printed last; raises with its log when it failed."""
    from refit_worker.rendezvous import FileStore, Layout

    base = {**os.environ, "PYTHONPATH": str(ROOT / "worker"), "BENCH_OPTS": json.dumps(opts)}
    base.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    procs = {}
    for role in ("rollout", "policy"):
        procs[role] = subprocess.Popen(
            [str(python), scripts[role], "--role", role],
            env={**base, **envs[role]},
            stdout=subprocess.PIPE,
            stderr=open(tmp / f"{role}.log", "w"),  # noqa: SIM115
            text=True,
        )
    FileStore(tmp / "rdzv", Layout(1, rollouts, 1)).open_barrier(0, timeout=900)
    out, _ = procs["rollout"].communicate(timeout=1800)
    procs["policy"].wait(timeout=120)
    if procs["rollout"].returncode != 0:
        raise RuntimeError((tmp / "rollout.log").read_text()[-4000:])
    figures: list[dict[str, Any]] = json.loads(out.strip().splitlines()[-1])["figures"]
    return figures


def drive(args: argparse.Namespace) -> int:
    started = time.monotonic()
    refits = args.warmup + args.runs
    opts = {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "vocab")}
    try:
        python = engine_python()
        with tempfile.TemporaryDirectory(prefix="vllm-landing-") as tmp:
            opts["dir"] = tmp
            envs = {r: _env(Path(tmp) / "rdzv", r, refits, args.bucket_mib << 20) for r in ROLES}
            figures = run_pair(python, opts, envs, dict.fromkeys(ROLES, __file__), Path(tmp))
    except RuntimeError as exc:
        print(f"vllm_landing: {exc}")
        return 1
    report(figures[args.warmup :], args, time.monotonic() - started)
    return 0


ROLES = ("rollout", "policy")


def report(figures: list[dict[str, Any]], args: argparse.Namespace, elapsed: float) -> None:
    mb = figures[0]["bytes"] / 1e6
    print(
        f"vLLM landing vs transfer: {mb:.0f} MB per refit, {args.runs} timed refits after "
        f"{args.warmup} warm-up; load average {os.getloadavg()[0]:.1f}; {elapsed:.0f} s in all"
    )
    print(
        f"  {'refit':>6}  {'transfer s':>10}  {'landing s':>9}  {'check s':>8}"
        f"  {'landing/transfer':>16}  {'check/transfer':>14}"
    )
    for f in figures:
        print(_row(str(f["refit_id"]), f["transfer_s"], f["landing_s"], f["verify_s"]))
    transfer, landing, check = (
        statistics.median(f[k] for f in figures) for k in ("transfer_s", "landing_s", "verify_s")
    )
    print(
        _row("median", transfer, landing, check)
        + f"   (transfer {mb / transfer / 1e3:.2f} GB/s; landing {mb / landing / 1e3:.2f} GB/s)"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "case": "vllm-landing",
                    "bytes": figures[0]["bytes"],
                    "transfer_s": transfer,
                    "landing_s": landing,
                    "check_s": check,
                    "landing_over_transfer": landing / transfer,
                    "check_over_transfer": check / transfer,
                }
            )
        )


def _row(label: str, transfer: float, landing: float, check: float) -> str:
    return (
        f"  {label:>6}  {transfer:>10.4f}  {landing:>9.4f}  {check:>8.4f}"
        f"  {landing / transfer:>16.2f}  {check / transfer:>14.2f}"
    )


def arguments(doc: str, roles: tuple[str, ...]) -> argparse.ArgumentParser:
    """The bench's options (the model's size, the refits), shared with ``vllm_tp.py``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--runs", type=int, default=3, help="timed refits (median of these)")
    parser.add_argument("--warmup", type=int, default=1, help="refits before the timed ones")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--bucket-mib", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="a JSON line after the table")
    parser.add_argument("--role", choices=roles, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, ("policy", "rollout"))
    args = parser.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        parser.error("--runs must be >= 1 and --warmup >= 0")
    if args.role is not None:
        role_opts = json.loads(os.environ["BENCH_OPTS"])
        (policy if args.role == "policy" else rollout)(role_opts)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
