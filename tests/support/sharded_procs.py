"""Helpers for the sharded-trainer tests: FSDP2 / tensor-parallel policy ranks as real processes.

Policy ranks form a real gloo group (``torch.distributed``, file rendezvous), build the same
tiny HF Llama (``transformers``), shard it with FSDP2 (``fully_shard``) or tensor parallelism
(``ColwiseParallel``/``RowwiseParallel``), and send its DTensor ``named_parameters()`` through
a real ``RefitSession`` (file-backed rendezvous store, real NIXL); between refits they take a
real optimizer step on fixed tokens.  Rollout ranks receive into a plain HF model of their
own (no DTensor, no process group) with ``receive_into(model)``.

During every ``send`` the policy ranks count the collectives they issue
(:class:`CollectiveCounter`: every ``torch.distributed`` collective function, and every op
of the c10d / functional-collective namespaces seen by a dispatch mode, which is how
``full_tensor()`` all-gathers).  Refit ``gather_at`` goes upstream's way instead
(``full_tensor()`` per parameter inside the counted window): the counter's positive control.
Expected digests of the full weights are computed after each send, outside the window.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import multiprocessing as mp
import queue
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tests.support.engine_procs import digest
from torch.utils._python_dispatch import TorchDispatchMode

CTX = mp.get_context("spawn")
PATIENCE_S = 480.0
#: Functions of ``torch.distributed`` that talk to the group; each call is counted.
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
)
_OP_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


@dataclass
class ShardedJob:
    layout: str  # "fsdp" or "tp"
    rollouts: int = 1
    refits: int = 2
    policy: int = 2
    #: This refit goes upstream's way: full_tensor() per parameter inside the counted window.
    gather_at: int = -1
    tie: bool = True  # tie_word_embeddings
    mode: str = "in_place"
    bucket_size: int = 64 << 10
    timeout_s: float = 60.0
    store: str = ""
    pg: str = ""
    #: ``transfer.delta`` (None: off).
    delta: str | None = None
    #: Only parameters whose name holds this are stepped ('': all), so a delta is small.
    train: str = ""


class CollectiveCounter(TorchDispatchMode):
    """Counts collectives on this rank while active (functions and dispatched ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        namespace = func.namespace if hasattr(func, "namespace") else ""
        if namespace in _OP_NAMESPACES:
            self.calls.append(f"{namespace}.{func.__name__}")
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(self) -> Iterator[CollectiveCounter]:
        import torch.distributed as dist

        originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

        def wrap(name: str, fn: Any) -> Any:
            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls.append(f"torch.distributed.{name}")
                return fn(*args, **kwargs)

            return counted

        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        try:
            with self:
                yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def llama_config(tie: bool) -> Any:
    from transformers import LlamaConfig

    # vocab 511: uneven over 2 ranks (256 + 255 rows)
    return LlamaConfig(
        vocab_size=511,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )


def build_model(tie: bool, seed: int) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(tie)).float()


def shard(model: Any, layout: str, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    if layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan = {
            f"model.layers.{i}.{part}": style
            for i in range(len(model.model.layers))
            for part, style in (
                ("self_attn.q_proj", ColwiseParallel()),
                ("self_attn.k_proj", ColwiseParallel()),
                ("self_attn.v_proj", ColwiseParallel()),
                ("self_attn.o_proj", RowwiseParallel()),
                ("mlp.gate_proj", ColwiseParallel()),
                ("mlp.up_proj", ColwiseParallel()),
                ("mlp.down_proj", RowwiseParallel()),
            )
        }
        parallelize_module(model, mesh, plan)
    else:
        raise ValueError(f"unknown layout {layout!r}")


def refusals_main(pg: str, out_q: Any) -> None:
    """One policy rank (a gloo group of 1): the refusal of each unsupported placement."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.placement_types import _StridedShard

    from refit_worker.engine.policy.dtensors import local_sources

    dist.init_process_group("gloo", init_method=f"file://{pg}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    model = build_model(tie=True, seed=0)
    found = {}
    for label, placement in (("strided", _StridedShard(0, split_factor=2)), ("partial", Partial())):
        weights: list[tuple[str, torch.Tensor]] = [
            (n, p.detach()) for n, p in model.named_parameters()
        ]
        name, full = weights[1]
        weights[1] = (name, DTensor.from_local(full, mesh, [placement], run_check=False))
        try:
            local_sources(weights, rank=0, world_size=1, device=torch.device("cpu"))
            found[label] = "accepted"
        except ValueError as exc:
            found[label] = str(exc)
    dist.destroy_process_group()
    out_q.put(json.dumps(found))


def run_refusals(tmp: Path) -> dict[str, str]:
    """The refusal messages for ``_StridedShard`` and ``Partial`` weights, by label."""
    out_q = CTX.Queue()
    proc = CTX.Process(target=refusals_main, args=(str(tmp / "pg"), out_q))
    proc.start()
    try:
        return dict(json.loads(out_q.get(timeout=PATIENCE_S)))
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _config(job: ShardedJob, role: str, rank: int) -> Any:
    from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig

    return WorkerConfig(
        job="sharded",
        role=role,  # type: ignore[arg-type]
        rank=rank,
        policy_world_size=job.policy,
        rollout_world_size=job.rollouts,
        pod_uid=str(uuid.uuid4()),
        pod_name=f"sharded-{role}-{rank}",
        transfer=TransferConfig(
            bucket_size=job.bucket_size, timeout_seconds=job.timeout_s, delta=job.delta
        ),
        rendezvous=RendezvousConfig(store="file", location=job.store),
    )


def _full(model: Any) -> dict[str, torch.Tensor]:
    """The full weights (a collective on DTensors: only outside the counted window)."""
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for n, p in model.named_parameters()
    }


def _train_step(model: Any, optimizer: Any, step: int) -> None:
    gen = torch.Generator().manual_seed(50 + step)
    tokens = torch.randint(0, 511, (2, 16), generator=gen)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def policy_main(job_json: str, rank: int, out_q: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from refit_worker import RefitSession

    job = ShardedJob(**json.loads(job_json))
    faulthandler.dump_traceback_later(0.95 * PATIENCE_S, exit=True)
    report: dict[str, Any] = {"role": "policy", "rank": rank, "refits": [], "collectives": []}
    dist.init_process_group(
        "gloo", init_method=f"file://{job.pg}", rank=rank, world_size=job.policy
    )
    model = build_model(job.tie, seed=0)
    session = RefitSession(_config(job, "policy", rank))
    try:
        shard(model, job.layout, job.policy)
        report["placements"] = {
            n: [f"{type(pl).__name__}({getattr(pl, 'dim', '')})" for pl in p.placements]
            for n, p in model.named_parameters()
            if isinstance(p, DTensor)
        }
        trained = [p for n, p in model.named_parameters() if job.train in n]
        optimizer = torch.optim.AdamW(trained, lr=1e-2)
        session.connect()
        for refit in range(job.refits):
            if refit:
                _train_step(model, optimizer, refit)
            counter = CollectiveCounter()
            with counter.counting():
                if refit == job.gather_at:  # both gather, then take turns by bucket
                    sent = [(n, p.full_tensor()) for n, p in model.named_parameters()]
                else:
                    sent = list(model.named_parameters())
                stats = asyncio.run(session.send(sent, refit_id=refit))
            report.setdefault("bytes", []).append(stats.bytes)
            report["collectives"].append(counter.calls)
            full = _full(model)
            report["refits"].append({n: digest(t) for n, t in full.items()})
            report["model_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
    except Exception as exc:
        report["error_type"] = type(exc).__name__
        report["error"] = str(exc)
    with contextlib.suppress(Exception):
        session.close()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    out_q.put(json.dumps(report))


def rollout_main(job_json: str, rank: int, out_q: Any) -> None:
    from refit_worker import RefitSession

    job = ShardedJob(**json.loads(job_json))
    faulthandler.dump_traceback_later(0.95 * PATIENCE_S, exit=True)
    report: dict[str, Any] = {"role": "rollout", "rank": rank, "refits": []}
    model = build_model(job.tie, seed=1000 + rank)  # other weights: the refit must replace them
    session = RefitSession(_config(job, "rollout", rank))
    try:
        session.connect()
        for refit in range(job.refits):
            asyncio.run(session.receive_into(model, refit_id=refit, mode=job.mode))  # type: ignore[arg-type]
            report["refits"].append({n: digest(t) for n, t in model.named_parameters()})
            if job.tie:
                head, embed = model.lm_head.weight, model.model.embed_tokens.weight
                report["tied"] = head.data_ptr() == embed.data_ptr() and torch.equal(head, embed)
    except Exception as exc:
        report["error_type"] = type(exc).__name__
        report["error"] = str(exc)
    with contextlib.suppress(Exception):
        session.close()
    out_q.put(json.dumps(report))


def run_sharded_job(job: ShardedJob, tmp: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """Start every rank, open the barrier, collect every report; never hangs."""
    from refit_worker.rendezvous import FileStore, Layout

    job.store, job.pg = str(tmp / "rdzv"), str(tmp / "pg")
    ranks = [("policy", r) for r in range(job.policy)] + [
        ("rollout", r) for r in range(job.rollouts)
    ]
    out_q = CTX.Queue()
    procs = {
        key: CTX.Process(
            target=policy_main if key[0] == "policy" else rollout_main,
            args=(json.dumps(asdict(job)), key[1], out_q),
        )
        for key in ranks
    }
    for proc in procs.values():
        proc.start()
    reports: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        FileStore(Path(job.store), Layout(job.policy, job.rollouts, 1)).open_barrier(
            0, timeout=PATIENCE_S / 2
        )
        deadline = time.monotonic() + PATIENCE_S
        while len(reports) < len(ranks):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(procs) - set(reports))} did not report")
            with contextlib.suppress(queue.Empty):
                message = json.loads(out_q.get(timeout=0.1))
                reports[(message["role"], message["rank"])] = message
            if any(procs[k].exitcode not in (None, 0) for k in procs if k not in reports):
                raise RuntimeError(f"a rank died: { {k: p.exitcode for k, p in procs.items()} }")
    finally:
        for proc in procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    return reports
