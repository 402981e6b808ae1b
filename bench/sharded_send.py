"""Sharded send against gather-then-send: 2 FSDP2 policy ranks -> 1 rollout rank, in ONE run.

Both cases move the same FSDP2 model (``fully_shard`` per layer and at the root, gloo, two
policy processes; ~1 GiB of float32 by default, the embedding's 16001 rows sharded
unevenly) into one rollout process's plain tensors over real NIXL (UCX), with integrity
hashes on, through the same :class:`NIXLCheckpointEngine` set-up:

* ``sharded``: ``send_weights(model.named_parameters())``: each policy rank WRITEs only
  its own local shards, no collective;
* ``gather`` (upstream's way, the baseline): ``full_tensor()`` per parameter on both ranks
  (the all-gather FSDP2 needs), then policy rank 0 sends the full model alone.

A refit is timed from a barrier of the policy ranks (outside the timing) to the last policy
rank's return from its send (the rollout rank confirmed every byte verified).  Every figure
is the median of ``--runs`` refits per case after one warm-up refit each, the cases
alternating; the ratio printed is gather seconds / sharded seconds (>1: sharded is faster).
The rollout's weights are checked bit-exact against the gathered model at the end.

``--json`` adds one JSON line (``case``, ``topology``, ``model_mib``, ``sharded_s``,
``gather_s``, ``x_gather``, ``sharded_gbps``, ``gather_gbps``, ``verified``, ...).
``--quick``: a ~10 MiB model, for the test that runs the benches.

Usage: ``python bench/sharded_send.py [--runs 3] [--quick] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))

import torch
import xxhash

CTX = mp.get_context("spawn")
WAIT_S = 900.0
BUCKET = 64 << 20


def build(layers: int, hidden: int, vocab: int, rank: int) -> torch.nn.Module:
    """An FSDP2 model built on the meta device, then only the local shards allocated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Embedding(vocab, hidden),
            *(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)),
        )
    mesh = init_device_mesh("cpu", (2,))
    for layer in list(model)[1:]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local()  # type: ignore[operator]
            local.copy_(torch.rand(local.shape, generator=gen))
    return model


def fingerprint(state: dict[str, torch.Tensor]) -> str:
    digest = xxhash.xxh3_64()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _engine() -> Any:
    from refit_worker.engine import NIXLCheckpointEngine

    # stripe=False: in the gather case only policy rank 0 sends (upstream's pairing); a
    # sharded refit reaches every rollout rank from every rank that holds a block anyway.
    return NIXLCheckpointEngine(BUCKET, device="cpu", checksum=True, stripe=False, timeout_s=600)


def policy(rank: int, job: dict[str, Any], meta_q: Any, peers_q: Any, res_q: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{job['pg']}", rank=rank, world_size=2)
    model = build(job["layers"], job["hidden"], job["vocab"], rank)
    engine = _engine()
    meta_q.put((("policy", rank), engine.prepare().model_dump_json()))
    metadata = peers_q.get(timeout=WAIT_S)
    engine.init_policy_process_group(
        worker_rank=rank, train_world_size=2, rollout_world_size=1, metadata=metadata
    )
    times: list[tuple[str, float]] = []
    gathered: dict[str, torch.Tensor] = {}
    for refit, case in enumerate(job["order"]):
        dist.barrier()
        t0 = time.perf_counter()
        if case == "sharded":
            asyncio.run(engine.send_weights(model.named_parameters(), refit_id=refit))
        else:
            gathered = {
                n: p.full_tensor() if isinstance(p, DTensor) else p.detach()
                for n, p in model.named_parameters()
            }
            if rank == 0:  # rank 1 sits this refit out: its refit id is set explicitly
                asyncio.run(engine.send_weights(iter(gathered.items()), refit_id=refit))
        times.append((case, time.perf_counter() - t0))
    res_q.put(("policy", rank, times, fingerprint(gathered) if rank == 0 else ""))
    engine.finalize()
    dist.destroy_process_group()


def rollout(job: dict[str, Any], meta_q: Any, peers_q: Any, res_q: Any) -> None:
    engine = _engine()
    meta_q.put((("rollout", 0), engine.prepare().model_dump_json()))
    metadata = peers_q.get(timeout=WAIT_S)
    engine.init_rollout_process_group(
        rollout_rank=0, train_world_size=2, rollout_world_size=1, metadata=metadata
    )
    state: dict[str, torch.Tensor] = {}

    def into(specs: Any) -> dict[str, torch.Tensor]:
        from refit_worker.engine.base import dtype_from_name

        if not state:
            for spec in specs:
                state[spec.name] = torch.zeros(spec.shape, dtype=dtype_from_name(spec.dtype))
        return state

    prints = []
    for refit in range(len(job["order"])):
        asyncio.run(engine.receive_into(into, refit_id=refit))
        prints.append(fingerprint(state))
    res_q.put(("rollout", 0, prints, ""))
    engine.finalize()


def run(job: dict[str, Any]) -> dict[str, Any]:
    meta_q, res_q = CTX.Queue(), CTX.Queue()
    peer_qs = [CTX.Queue() for _ in range(3)]
    procs = [
        CTX.Process(target=policy, args=(0, job, meta_q, peer_qs[0], res_q)),
        CTX.Process(target=policy, args=(1, job, meta_q, peer_qs[1], res_q)),
        CTX.Process(target=rollout, args=(job, meta_q, peer_qs[2], res_q)),
    ]
    for proc in procs:
        proc.start()
    try:
        found = dict(meta_q.get(timeout=WAIT_S) for _ in procs)
        ordered = [found[("policy", 0)], found[("policy", 1)], found[("rollout", 0)]]
        for peer_q in peer_qs:
            peer_q.put(ordered)
        results = {}
        deadline = time.monotonic() + WAIT_S
        while len(results) < len(procs):
            if time.monotonic() > deadline:
                raise TimeoutError("the bench's ranks did not report in time")
            try:
                role, rank, values, extra = res_q.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a rank died: {[p.exitcode for p in procs]}") from None
                continue
            results[(role, rank)] = (values, extra)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="timed refits per case (median)")
    parser.add_argument("--quick", action="store_true", help="a ~10 MiB model (tests)")
    parser.add_argument("--json", action="store_true", help="also print one JSON line")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    layers, hidden, vocab = (4, 512, 1001) if args.quick else (12, 4096, 16001)
    with tempfile.TemporaryDirectory(prefix="refit-sharded-bench-") as tmp:
        job = {
            "layers": layers,
            "hidden": hidden,
            "vocab": vocab,
            "pg": str(Path(tmp) / "pg"),
            "order": ["sharded", "gather"] * (args.runs + 1),  # the first pair warms up
        }
        nbytes = (layers * hidden * hidden + vocab * hidden) * 4
        print(
            f"sharded send vs gather-then-send: 2 FSDP2 ranks -> 1 rollout, "
            f"{nbytes / 2**20:.0f} MiB float32, {args.runs} runs + 1 warm-up per case, "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        results = run(job)
    per_rank = [results[("policy", r)][0] for r in (0, 1)]
    timed: dict[str, list[float]] = {"sharded": [], "gather": []}
    for index, case in enumerate(job["order"]):
        if index >= 2:  # the first pair warmed up
            timed[case].append(max(times[index][1] for times in per_rank))
    sharded, gather = statistics.median(timed["sharded"]), statistics.median(timed["gather"])
    prints = results[("rollout", 0)][0]
    verified = len(set(prints)) == 1 and prints[-1] == results[("policy", 0)][1]
    line = {
        "case": "sharded-send",
        "topology": "2x1",
        "model_mib": round(nbytes / 2**20, 1),
        "runs": args.runs,
        "sharded_s": round(sharded, 4),
        "gather_s": round(gather, 4),
        "x_gather": round(gather / sharded, 3),
        "sharded_gbps": round(nbytes / sharded / 1e9, 3),
        "gather_gbps": round(nbytes / gather / 1e9, 3),
        "sharded_runs_s": [round(t, 4) for t in timed["sharded"]],
        "gather_runs_s": [round(t, 4) for t in timed["gather"]],
        "verified": verified,
    }
    print(f"{'case':<10} {'median s':>9} {'GB/s':>7}  runs (s)")
    for case, median in (("sharded", sharded), ("gather", gather)):
        runs = " ".join(f"{t:.3f}" for t in timed[case])
        print(f"{case:<10} {median:>9.3f} {nbytes / median / 1e9:>7.2f}  {runs}")
    print(
        f"ratio: gather-then-send takes {gather / sharded:.2f}x the sharded send's time; "
        f"rollout bit-exact with the gathered model: {verified}"
    )
    if args.json:
        print(json.dumps(line))
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
