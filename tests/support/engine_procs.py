"""Helpers for the engine's end-to-end tests (``tests/e2e/test_nixl_*.py``): real
processes, real NIXL (UCX) transfers.

Each rank is a separate process started with ``multiprocessing`` (spawn).  Metadata and
results cross process boundaries only as JSON strings in queues.  Nothing is emulated.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import hashlib
import json
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_worker.engine import TargetWeightLayout
from refit_worker.engine.planning.layout import WHOLE, select_slice

CTX = mp.get_context("spawn")
JOIN_TIMEOUT_S = float(os.environ.get("REFIT_TEST_JOIN_TIMEOUT_S", "90"))


def state_dict(refit: int, *, experts: int = 0) -> dict[str, torch.Tensor]:
    """A small, mixed-dtype, deterministic state dict that differs per refit."""
    gen = torch.Generator().manual_seed(1000 + refit)
    sd: dict[str, torch.Tensor] = {
        "embed.weight": torch.randn(257, 64, generator=gen).to(torch.bfloat16),
        "big.weight": torch.randn(300, 301, generator=gen),  # > one bucket in the tests
        "empty.bias": torch.zeros(0, dtype=torch.float16),
        "odd.int8": torch.randint(-128, 127, (37,), dtype=torch.int8, generator=gen),
        "mask.bool": torch.randint(0, 2, (13, 3), generator=gen).bool(),
        "fp8.weight": torch.randn(33, 7, generator=gen).to(torch.float8_e4m3fn),
        "head.fp16": torch.randn(9, 70, generator=gen).half(),
        "scalar.step": torch.tensor(refit, dtype=torch.int64),
    }
    for e in range(experts):
        sd[f"layers.0.mlp.experts.{e}.up.weight"] = torch.randn(8, 16, generator=gen)
    if experts:
        sd["layers.0.attn.q_proj.weight"] = torch.randn(16, 16, generator=gen)
    return sd


def digest(tensor: torch.Tensor) -> str:
    """Bit-exact fingerprint: dtype, shape and the raw bytes."""
    flat = tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
    raw = flat.numpy().tobytes()
    return f"{tensor.dtype}|{list(tensor.shape)}|{hashlib.sha256(raw).hexdigest()}"


@dataclass
class Job:
    """One run: world sizes, engine settings and what each side does."""

    train: int
    rollout: int
    refits: int = 1
    bucket_size: int = 64 << 10
    timeout_s: float = 20.0
    engine: dict[str, Any] = field(default_factory=dict)
    layouts: dict[str, dict[str, Any]] = field(default_factory=dict)  # rollout rank -> layout
    experts: int = 0
    hold_s: float = 0.0  # rollout pauses this long after its first batch (kill tests)
    release_cycles: bool = False
    device: str = "cpu"  # "cuda": the payload, buffers and landing memory in VRAM
    into: bool = False  # the rollout receives with receive_into (final tensors), not views


def patience(job: Job) -> float:
    """How long a whole run may take before the test gives up on it."""
    return JOIN_TIMEOUT_S * (1 + (job.refits if job.release_cycles else 1))


def _engine(job: Job, rank_role: str, rank: int) -> Any:
    from refit_worker.engine import NIXLCheckpointEngine, TargetWeightLayout

    layout = job.layouts.get(str(rank)) if rank_role == "rollout" else None
    return NIXLCheckpointEngine(
        job.bucket_size,
        device=job.device,
        timeout_s=job.timeout_s,
        shard_expert_weights=layout is not None,
        target_layout=TargetWeightLayout.model_validate(layout) if layout else None,
        release_after_refit=job.release_cycles,
        **job.engine,
    )


def _exchange(engine: Any, index: int, meta_q: Any, my_q: Any) -> list[str]:
    meta_q.put(json.dumps([index, engine.prepare().model_dump_json()]))
    return list(json.loads(my_q.get(timeout=JOIN_TIMEOUT_S)))


def rank_main(job_json: str, role: str, rank: int, meta_q: Any, my_q: Any, out_q: Any) -> None:
    """Process entry point: run ``job.refits`` refits as ``role`` ``rank``; report JSON."""
    job = Job(**json.loads(job_json))
    # A rank stuck past the test's patience prints where it is stuck and exits.
    faulthandler.dump_traceback_later(0.95 * patience(job), exit=True)
    index = rank if role == "policy" else job.train + rank
    report: dict[str, Any] = {"role": role, "rank": rank, "refits": []}
    started = time.monotonic()
    try:
        engine = _engine(job, role, rank)
        for refit in range(job.refits):
            if refit == 0 or job.release_cycles:
                metadata = _exchange(engine, index, meta_q, my_q)
                kwargs = {
                    "train_world_size": job.train,
                    "rollout_world_size": job.rollout,
                    "metadata": metadata,
                }
                if role == "policy":
                    engine.init_policy_process_group(worker_rank=rank, **kwargs)
                else:
                    engine.init_rollout_process_group(rollout_rank=rank, **kwargs)
            if role == "policy":
                sd = state_dict(refit, experts=job.experts)
                sd = {n: t.to(job.device) for n, t in sd.items()}
                timing = asyncio.run(engine.send_weights(iter(sd.items())))
                report["refits"].append(
                    {"delivered": list(timing.delivered), "dropped": dict(timing.dropped)}
                )
            else:
                report["refits"].append(asyncio.run(_receive(engine, job, out_q, rank)))
        engine.finalize()
    except Exception as exc:  # reported to the test, which asserts on it
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["error_type"] = type(exc).__name__
    report["elapsed_s"] = time.monotonic() - started
    out_q.put(json.dumps(report))


async def _receive(engine: Any, job: Job, out_q: Any, rank: int) -> dict[str, str]:
    if job.into:
        from refit_worker.engine.base import dtype_from_name

        def allocate(specs: Any) -> dict[str, torch.Tensor]:
            return {
                s.name: torch.empty(s.shape, dtype=dtype_from_name(s.dtype), device=job.device)
                for s in specs
            }

        landed = await engine.receive_into(allocate)
        return {name: digest(t) for name, t in landed.tensors.items()}
    got: dict[str, str] = {}
    first = True
    async for batch in engine.receive_weight_batches():
        for name, tensor in batch:
            if name in got:
                raise AssertionError(f"{name} yielded twice")
            got[name] = digest(tensor.clone())
        if first and job.hold_s:
            out_q.put(json.dumps({"role": "rollout", "rank": rank, "first_batch": True}))
            await asyncio.sleep(job.hold_s)
        first = False
    return got


@dataclass
class Run:
    reports: dict[tuple[str, int], dict[str, Any]]
    events: list[dict[str, Any]]
    arrived: dict[tuple[str, int], float]  # time.monotonic() when each report came in


def run_job(
    job: Job, on_event: Callable[[dict[str, Any], dict[tuple[str, int], Any]], None] | None = None
) -> Run:
    """Start every rank, broker the metadata, collect the reports; never hangs."""
    from dataclasses import asdict

    ranks = [("policy", r) for r in range(job.train)] + [("rollout", r) for r in range(job.rollout)]
    # One queue per rank and direction: a rank killed while writing would otherwise take a
    # shared queue's lock down with it and block every other writer.
    meta_qs = {key: CTX.Queue() for key in ranks}
    out_qs = {key: CTX.Queue() for key in ranks}
    own = {key: CTX.Queue() for key in ranks}
    env_before = dict(os.environ)
    procs = {
        key: CTX.Process(
            target=rank_main,
            args=(json.dumps(asdict(job)), key[0], key[1], meta_qs[key], own[key], out_qs[key]),
            daemon=True,
        )
        for key in ranks
    }
    for proc in procs.values():
        proc.start()
    os.environ.clear()
    os.environ.update(env_before)
    reports: dict[tuple[str, int], dict[str, Any]] = {}
    arrived: dict[tuple[str, int], float] = {}
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + patience(job)
    pending_meta: dict[int, str] = {}
    try:
        while len(reports) < len(ranks) - sum(
            not p.is_alive() and k not in reports
            for k, p in procs.items()
            if p.exitcode is not None and p.exitcode < 0
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(ranks) - set(reports))} did not report")
            for meta_q in meta_qs.values():
                with contextlib.suppress(queue.Empty):
                    index, meta = json.loads(meta_q.get_nowait())
                    pending_meta[index] = meta
            if len(pending_meta) == len(ranks):
                listing = json.dumps([pending_meta[i] for i in range(len(ranks))])
                for key in ranks:
                    own[key].put(listing)
                pending_meta = {}
            for out_q in out_qs.values():
                with contextlib.suppress(queue.Empty):
                    message = json.loads(out_q.get_nowait())
                    key = (message["role"], message["rank"])
                    if "first_batch" in message:
                        events.append(message)
                        if on_event:
                            on_event(message, procs)
                    else:
                        reports[key] = message
                        arrived[key] = time.monotonic()
            time.sleep(0.02)
    finally:
        for proc in procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    return Run(reports, events, arrived)


# -- what the tests expect of a run ------------------------------------------------------


def expected(
    refit: int, layout: dict[str, object] | None = None, experts: int = 0
) -> dict[str, str]:
    parsed = TargetWeightLayout.model_validate(layout) if layout else None
    out: dict[str, str] = {}
    for name, tensor in state_dict(refit, experts=experts).items():
        part = select_slice(name, tuple(tensor.shape), parsed)
        if part is None:
            continue
        sent = tensor if part == WHOLE else tensor.narrow(part.dim, part.start, part.length)
        out[name] = digest(sent)
    return out


def assert_all_ok(run: Any, job: Job) -> None:
    """Every rank reported, none an error, and every rollout refit bit-exact."""
    assert len(run.reports) == job.train + job.rollout
    for key, report in run.reports.items():
        assert "error" not in report, f"{key}: {report.get('error')}"
    for r in range(job.rollout):
        refits = run.reports[("rollout", r)]["refits"]
        assert len(refits) == job.refits
        for k, got in enumerate(refits):
            want = expected(k, job.layouts.get(str(r)), job.experts)
            assert got == want, f"rollout {r} refit {k}: mismatch in " + str(
                sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))
            )
