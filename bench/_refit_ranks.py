"""The processes behind ``bench/refit_throughput.py``: baselines and engine/session ranks.

Each measurement starts its own processes (``multiprocessing`` spawn); metadata and results
cross process boundaries as JSON strings in queues.  Session ranks meet over the file-backed
rendezvous store, whose barrier the parent opens, as the operator would.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import queue
import resource
import socket
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import xxhash

CTX = mp.get_context("spawn")
WAIT_S = 900.0
#: Untimed refits first: double buffering allocates (and registers) its second copy on the
#: second refit; from the third on every case is in its steady state.
WARMUP = 2
CASES = ("engine", "session", "session-in-place")
#: Diagnostic cases, run only when named in ``--cases``: the session without integrity hashes.
EXTRA_CASES = ("session-no-integrity",)


def state_dict(
    layers: int, hidden: int, vocab: int, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """bf16 transformer-shaped weights (values irrelevant to throughput, but not zero).

    Seeded: every policy rank holds the same weights, as data-parallel ranks do.
    """
    torch.manual_seed(1234)
    mlp = hidden * 2 // 3
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, hidden)}
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
            shapes[f"layers.{i}.{name}.weight"] = shape
    return {
        name: torch.empty(shape, dtype=torch.bfloat16, device=device).uniform_()
        if device != "meta"
        else torch.empty(shape, dtype=torch.bfloat16, device="meta")
        for name, shape in shapes.items()
    }


def meta_state_dict(shape: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    return state_dict(*shape, device="meta")


def fingerprint(state: dict[str, torch.Tensor]) -> str:
    """xxh3 over every tensor's bytes, in name order (CPU copies for device tensors)."""
    digest = xxhash.xxh3_64()
    for name in sorted(state):
        tensor = state[name].detach().contiguous().cpu()
        digest.update(name.encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# -- baselines ---------------------------------------------------------------------------
def bench_memcpy(size: int, runs: int, device: str) -> list[float]:
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    times = []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[1:]


def _raw_nixl(
    role: str, size: int, runs: int, device: str, q_in: Any, q_out: Any, res: Any
) -> None:
    from refit_worker.engine import NixlAgent, NixlAgentMetadata

    agent = NixlAgent()
    mem = "VRAM" if device == "cuda" else "DRAM"
    buf = (torch.ones if role == "tx" else torch.zeros)(size, dtype=torch.uint8, device=device)
    dev = buf.device.index or 0 if device == "cuda" else 0
    agent.register([(buf.data_ptr(), size, dev)], mem)
    q_out.put(agent.get_agent_metadata().model_dump_json())
    peer = agent.add_remote_agent(NixlAgentMetadata.model_validate_json(q_in.get(timeout=WAIT_S)))
    if role == "rx":
        q_out.put(json.dumps([buf.data_ptr(), size, dev]))
        for i in range(runs + 1):
            asyncio.run(agent.wait_notification(peer, f"x{i}".encode(), timeout=WAIT_S))
        return
    addr, length, rdev = json.loads(q_in.get(timeout=WAIT_S))
    # One WRITE handle, prepared once and posted again each run, as the engine does.
    prepared = agent.prepare_writes(
        peer, [(buf.data_ptr(), size, dev)], [(addr, length, rdev)], mem, [[0]]
    )
    times = []
    for i in range(runs + 1):
        t0 = time.perf_counter()
        agent.post_prepared(prepared.handles[0], peer, f"x{i}".encode())
        deadline = time.monotonic() + WAIT_S
        asyncio.run(agent.wait_posted(prepared.handles[0], peer, "raw buffer", deadline))
        times.append(time.perf_counter() - t0)
    prepared.release()
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


def bench_raw_nixl(size: int, runs: int, device: str) -> list[float]:
    a, b, res = CTX.Queue(), CTX.Queue(), CTX.Queue()
    out = _run(
        [
            (_raw_nixl, ("rx", size, runs, device, a, b, res)),
            (_raw_nixl, ("tx", size, runs, device, b, a, res)),
        ],
        res,
        1,
    )
    return list(json.loads(out[0]))


def _free_port() -> int:
    """A TCP port on loopback no one listens on now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bench_gloo(size: int, runs: int) -> list[float]:
    res, port = CTX.Queue(), 29000 + os.getpid() % 1000
    out = _run([(_gloo, (r, size, runs, port, res)) for r in (0, 1)], res, 1)
    return list(json.loads(out[0]))


# -- engine and session ranks ----------------------------------------------------------------
def _engine_rank(
    role: str, rank: int, cfg: dict[str, Any], meta_q: Any, own_q: Any, res: Any
) -> None:
    from refit_worker.engine import NIXLCheckpointEngine

    engine = NIXLCheckpointEngine(cfg["bucket"], device=cfg["device"], timeout_s=WAIT_S)
    index = rank if role == "policy" else cfg["train"] + rank
    meta_q.put(json.dumps([index, engine.prepare().model_dump_json()]))
    kw = {
        "train_world_size": cfg["train"],
        "rollout_world_size": cfg["rollout"],
        "metadata": json.loads(own_q.get(timeout=WAIT_S)),
    }
    if role == "policy":
        engine.init_policy_process_group(worker_rank=rank, **kw)
        sd = state_dict(*cfg["shape"], device=cfg["device"])
    else:
        engine.init_rollout_process_group(rollout_rank=rank, **kw)
    report: dict[str, list[Any]] = {"seconds": [], "control_s": [], "registrations": [], "cpu": []}
    for _ in range(cfg["runs"] + WARMUP):
        c0 = _cpu()
        t0 = time.perf_counter()
        if role == "policy":
            timing = asyncio.run(engine.send_weights(iter(sd.items())))
        else:
            timing = asyncio.run(_drain(engine))
        report["seconds"].append(time.perf_counter() - t0)
        report["cpu"].append(_cpu() - c0)
        report["control_s"].append(timing.control_s)
        report["registrations"].append(timing.registrations)
    engine.finalize()
    res.put(json.dumps([role, report]))


def _cpu() -> float:
    """CPU seconds (user + system, all threads) this process used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _drain(engine: Any) -> Any:
    """Take every batch of one refit; its RefitTiming."""
    timings: list[Any] = []
    async for _batch in engine.receive_weight_batches(on_complete=timings.append):
        pass
    return timings[0]


def _session_rank(role: str, rank: int, cfg: dict[str, Any], res: Any) -> None:
    from refit_worker import RefitSession, RolloutSession
    from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig

    config = WorkerConfig(
        job="bench",
        role=role,  # type: ignore[arg-type]
        rank=rank,
        policy_world_size=cfg["train"],
        rollout_world_size=cfg["rollout"],
        pod_uid=str(uuid.uuid4()),
        pod_name=f"bench-{role}-{rank}",
        transfer=TransferConfig(
            bucket_size=cfg["bucket"],
            device=cfg["device"],
            timeout_seconds=WAIT_S,
            checksum=cfg["case"] != "session-no-integrity",
        ),
        rendezvous=RendezvousConfig(store="file", location=cfg["store"]),
        # The policy ranks' own group (the session joins it to agree on each refit's plan).
        master_port=cfg["dist_port"],
    )
    session = RefitSession(config)
    session.connect()
    report: dict[str, Any] = {
        "seconds": [],
        "stats": [],
        "control_s": [],
        "registrations": [],
        "cpu": [],
    }
    if role == "policy":
        sd = state_dict(*cfg["shape"], device=cfg["device"])
    else:
        shapes = meta_state_dict(cfg["shape"])
        live = {
            n: torch.empty(t.shape, dtype=t.dtype, device=cfg["device"]) for n, t in shapes.items()
        }
    for refit in range(cfg["runs"] + WARMUP):
        c0 = _cpu()
        t0 = time.perf_counter()
        if role == "policy":
            stats = asyncio.run(session.send(sd.items(), refit_id=refit))
        elif cfg["case"] == "session-in-place":
            stats = asyncio.run(session.receive_into(live, refit_id=refit, mode="in_place"))
        else:
            stats = asyncio.run(session.receive(refit_id=refit))
        report["seconds"].append(time.perf_counter() - t0)
        report["cpu"].append(_cpu() - c0)
        report["stats"].append(stats.seconds)
        report["control_s"].append(stats.control_seconds)
        report["registrations"].append(stats.registrations)
    if isinstance(session, RolloutSession):  # a policy session holds no committed state
        committed = session.committed
        report["fingerprint"] = fingerprint(committed.state if committed else {})
    else:
        report["fingerprint"] = fingerprint(sd)
    session.close()
    res.put(json.dumps([role, report]))


def bench_engine(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one case; per timed refit: the slowest policy rank's seconds, and the rest."""
    res = CTX.Queue()
    ranks = [("policy", r) for r in range(cfg["train"])] + [
        ("rollout", r) for r in range(cfg["rollout"])
    ]
    if cfg["case"] == "engine":
        meta_q = CTX.Queue()
        own = [CTX.Queue() for _ in ranks]
        targets = [
            (_engine_rank, (role, r, cfg, meta_q, own[i], res)) for i, (role, r) in enumerate(ranks)
        ]
        out = _run(targets, res, len(ranks), broker=(meta_q, own))
    else:
        from refit_worker.rendezvous import FileStore, Layout

        store = FileStore(Path(cfg["store"]), Layout(cfg["train"], cfg["rollout"], 1))
        cfg = {**cfg, "dist_port": _free_port()}
        targets = [(_session_rank, (role, r, cfg, res)) for role, r in ranks]
        out = _run(targets, res, len(ranks), barrier=store)
    reports = [json.loads(x) for x in out]
    policy = [rep for role, rep in reports if role == "policy"]
    rollout = [rep for role, rep in reports if role == "rollout"]
    runs = cfg["runs"]
    timed = range(WARMUP, WARMUP + runs)
    result: dict[str, Any] = {
        # per timed refit: the slowest policy rank
        "seconds": [max(rep["seconds"][i] for rep in policy) for i in timed],
        # cold: the first refit; then the timed ones
        "control_s": [
            statistics.median(rep["control_s"][i] for rep in policy) for i in [0, *timed]
        ],
        "registrations": [
            max(rep["registrations"][i] for rep in policy + rollout) for i in range(WARMUP + runs)
        ],
        "verified": None,
        # CPU seconds per timed refit, median, summed over the ranks of each role
        "cpu_policy": statistics.median(sum(rep["cpu"][i] for rep in policy) for i in timed),
        "cpu_rollout": statistics.median(sum(rep["cpu"][i] for rep in rollout) for i in timed),
    }
    if cfg["case"] != "engine":
        result["rollout_seconds"] = [max(rep["stats"][i] for rep in rollout) for i in timed]
        prints = {rep["fingerprint"] for rep in policy + rollout}
        result["verified"] = len(prints) == 1
    return result


def _run(
    targets: list[tuple[Any, tuple[Any, ...]]],
    res: Any,
    expect: int,
    *,
    broker: tuple[Any, list[Any]] | None = None,
    barrier: Any = None,
) -> list[str]:
    procs = [CTX.Process(target=t, args=a, daemon=True) for t, a in targets]
    for p in procs:
        p.start()
    try:
        if broker is not None:
            meta_q, own = broker
            got = dict(json.loads(meta_q.get(timeout=120)) for _ in own)
            listing = json.dumps([got[i] for i in range(len(own))])
            for q in own:
                q.put(listing)
        if barrier is not None:
            barrier.open_barrier(0, timeout=120)
        out: list[str] = []
        deadline = time.monotonic() + WAIT_S
        while len(out) < expect:
            try:
                out.append(res.get(timeout=1.0))
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"benchmark processes failed (exit codes {failed})"
                    ) from None
        return out
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
