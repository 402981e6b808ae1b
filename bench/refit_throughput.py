"""Refit throughput: the NIXL engine against memcpy, raw NIXL and gloo, in ONE run.

Every number is a median of ``--runs`` timed repetitions (after one warm-up) measured in
this run, and the engine is printed as a ratio to each baseline:

* memcpy: ``torch`` copy of the payload size inside one process;
* raw NIXL: one registered buffer of the payload size WRITTEN between two processes;
* gloo: ``torch.distributed`` send/recv of the payload between two processes;
* engine: ``NIXLCheckpointEngine`` end to end (``send_weights`` start -> receiver confirmed
  the manifest) on a transformer-like bf16 state dict, per bucket size and topology.
  The receiving consumer only counts the yielded views (upstream leaves the copy to it).

``--tcp`` sets ``UCX_TLS=tcp`` for the child processes (the cross-pod case: no CMA).

Usage: ``python bench/refit_throughput.py [--runs 3] [--quick] [--tcp]``.
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
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))

import torch

CTX = mp.get_context("spawn")
WAIT_S = 900.0


def state_dict(layers: int, hidden: int, vocab: int) -> dict[str, torch.Tensor]:
    """bf16 transformer-shaped weights (values irrelevant to throughput, but not zero)."""
    mlp = hidden * 2 // 3
    sd = {"embed.weight": torch.empty(vocab, hidden, dtype=torch.bfloat16).uniform_()}
    for i in range(layers):
        for name, shape in (
            ("q", (hidden, hidden)),
            ("k", (hidden, hidden)),
            ("v", (hidden, hidden)),
            ("o", (hidden, hidden)),
            ("up", (mlp, hidden)),
            ("down", (hidden, mlp)),
            ("norm", (hidden,)),
        ):
            sd[f"layers.{i}.{name}.weight"] = torch.empty(shape, dtype=torch.bfloat16).uniform_()
    return sd


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def _bench_memcpy(size: int, runs: int) -> list[float]:
    src, dst = torch.ones(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
    times = []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times[1:]


def _raw_nixl(role: str, size: int, runs: int, q_in: Any, q_out: Any, res: Any) -> None:
    from refit_worker.checkpoint_engines import NixlAgent

    agent = NixlAgent()
    fill = torch.ones if role == "tx" else torch.zeros
    buf = fill(size, dtype=torch.uint8)
    agent.register([(buf.data_ptr(), size, 0)], "DRAM")
    q_out.put(agent.get_agent_metadata().model_dump_json())
    from refit_worker.checkpoint_engines import NixlAgentMetadata

    peer = agent.add_remote_agent(NixlAgentMetadata.model_validate_json(q_in.get(timeout=WAIT_S)))
    if role == "rx":
        q_out.put(json.dumps([buf.data_ptr(), size]))
        for i in range(runs + 1):
            asyncio.run(agent.wait_notification(peer, f"x{i}".encode(), timeout=WAIT_S))
        return
    addr, length = json.loads(q_in.get(timeout=WAIT_S))
    times = []
    for i in range(runs + 1):
        t0 = time.perf_counter()
        handle = agent.post_write(
            peer, [(buf.data_ptr(), size, 0)], [(addr, length, 0)], "DRAM", f"x{i}".encode()
        )
        asyncio.run(agent.wait_transfer(handle, peer, "raw buffer", time.monotonic() + WAIT_S))
        times.append(time.perf_counter() - t0)
    res.put(json.dumps(times[1:]))


def _gloo(rank: int, size: int, runs: int, port: int, res: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.ones(size, dtype=torch.uint8) if rank == 0 else torch.zeros(size, dtype=torch.uint8)
    times = []
    for _ in range(runs + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        res.put(json.dumps(times[1:]))
    dist.destroy_process_group()


def _engine_rank(
    role: str, rank: int, cfg: dict[str, Any], meta_q: Any, own_q: Any, res: Any
) -> None:
    from refit_worker.checkpoint_engines import NIXLCheckpointEngine

    engine = NIXLCheckpointEngine(cfg["bucket"], device="cpu", timeout_s=WAIT_S)
    index = rank if role == "policy" else cfg["train"] + rank
    meta_q.put(json.dumps([index, engine.prepare().model_dump_json()]))
    metadata = json.loads(own_q.get(timeout=WAIT_S))
    kw = {
        "train_world_size": cfg["train"],
        "rollout_world_size": cfg["rollout"],
        "metadata": metadata,
    }
    if role == "policy":
        engine.init_policy_process_group(worker_rank=rank, **kw)
        sd = state_dict(cfg["layers"], cfg["hidden"], cfg["vocab"])
    else:
        engine.init_rollout_process_group(rollout_rank=rank, **kw)
    times = []
    for _ in range(cfg["runs"] + 1):
        t0 = time.perf_counter()
        if role == "policy":
            asyncio.run(engine.send_weights(iter(sd.items())))
        else:
            asyncio.run(_drain(engine))
        times.append(time.perf_counter() - t0)
    engine.finalize()
    res.put(json.dumps([role, times[1:]]))


async def _drain(engine: Any) -> int:
    count = 0
    async for batch in engine.receive_weight_batches():
        count += len(batch)
    return count


def _run(
    targets: list[tuple[Any, tuple[Any, ...]]],
    broker: tuple[Any, list[Any]] | None,
    res: Any,
    expect: int,
) -> list[str]:
    procs = [CTX.Process(target=t, args=a, daemon=True) for t, a in targets]
    for p in procs:
        p.start()
    if broker is not None:
        meta_q, own = broker
        got = dict(json.loads(meta_q.get(timeout=120)) for _ in own)
        listing = json.dumps([got[i] for i in range(len(own))])
        for q in own:
            q.put(listing)
    out: list[str] = []
    deadline = time.monotonic() + WAIT_S
    while len(out) < expect:
        try:
            out.append(res.get(timeout=1.0))
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"benchmark processes failed (exit codes {failed})") from None
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return out


def bench_raw_nixl(size: int, runs: int) -> list[float]:
    a, b, res = CTX.Queue(), CTX.Queue(), CTX.Queue()
    out = _run(
        [(_raw_nixl, ("rx", size, runs, a, b, res)), (_raw_nixl, ("tx", size, runs, b, a, res))],
        None,
        res,
        1,
    )
    return list(json.loads(out[0]))


def bench_gloo(size: int, runs: int) -> list[float]:
    res, port = CTX.Queue(), 29000 + os.getpid() % 1000
    out = _run([(_gloo, (r, size, runs, port, res)) for r in (0, 1)], None, res, 1)
    return list(json.loads(out[0]))


def bench_engine(cfg: dict[str, Any]) -> list[float]:
    meta_q, res = CTX.Queue(), CTX.Queue()
    ranks = [("policy", r) for r in range(cfg["train"])] + [
        ("rollout", r) for r in range(cfg["rollout"])
    ]
    own = [CTX.Queue() for _ in ranks]
    targets = [
        (_engine_rank, (role, r, cfg, meta_q, own[i], res)) for i, (role, r) in enumerate(ranks)
    ]
    out = [json.loads(x) for x in _run(targets, (meta_q, own), res, len(ranks))]
    per_run = [max(t[i] for role, t in out if role == "policy") for i in range(cfg["runs"])]
    return per_run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="timed runs per case (median)")
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--tcp", action="store_true", help="UCX_TLS=tcp in the child processes")
    parser.add_argument("--buckets", default="16,64,256", help="bucket sizes in MiB")
    parser.add_argument("--topologies", default="1x1,2x2", help="policy x rollout ranks")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    if args.tcp:
        os.environ["UCX_TLS"] = "tcp"
    shape = (2, 256, 4096) if args.quick else (24, 2048, 32000)
    buckets = [int(x) for x in args.buckets.split(",")]
    if args.quick:
        buckets = [1, 4]
    size = nbytes(state_dict(*shape) if args.quick else _meta_size(shape))
    print(
        f"payload {size / 2**20:.0f} MiB, runs {args.runs}, UCX_TLS="
        f"{os.environ.get('UCX_TLS', '(default)')}, load {os.getloadavg()}",
        flush=True,
    )
    gbps = {
        "memcpy": size / statistics.median(_bench_memcpy(size, args.runs)) / 1e9,
        "raw NIXL": size / statistics.median(bench_raw_nixl(size, args.runs)) / 1e9,
        "gloo": size / statistics.median(bench_gloo(size, args.runs)) / 1e9,
    }
    for name, value in gbps.items():
        print(f"{name:>10}: {value:6.2f} GB/s", flush=True)
    print(
        f"{'topology':>8} {'bucket':>7} {'GB/s':>6} " + " ".join(f"{'x ' + n:>11}" for n in gbps),
        flush=True,
    )
    for topo in args.topologies.split(","):
        train, rollout = (int(x) for x in topo.split("x"))
        for mib in buckets:
            cfg = {
                "train": train,
                "rollout": rollout,
                "bucket": mib << 20,
                "runs": args.runs,
                "layers": shape[0],
                "hidden": shape[1],
                "vocab": shape[2],
            }
            moved = size * max(train, rollout) if train <= rollout else size * rollout
            rate = moved / statistics.median(bench_engine(cfg)) / 1e9
            ratios = " ".join(f"{rate / v:11.2f}" for v in gbps.values())
            print(f"{topo:>8} {mib:>4}MiB {rate:6.2f} {ratios}", flush=True)


def _meta_size(shape: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return state_dict(*shape)


if __name__ == "__main__":
    main()
