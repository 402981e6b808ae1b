"""Helpers for the FSDP2 adapter refit test: policy ranks whose LoRA adapter is sharded.

Two policy ranks form a real gloo group and hold a LoRA adapter (PEFT's parameter names
and shapes for q_proj and v_proj of a 2-layer model) sharded by FSDP2's ``fully_shard``
(every parameter a DTensor, ``Shard(0)``); between refits AdamW takes a real step.  Each
rank sends its own shards with ``send(..., adapter=header)`` inside a
:class:`~tests.support.sharded_procs.CollectiveCounter` window (no gather of the adapter, no
base model at all), and reports the full adapter's digests, gathered after the send.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import uuid
from typing import Any

import torch
from tests.support.engine_procs import digest
from tests.support.sharded_procs import PATIENCE_S, CollectiveCounter

RANK, HIDDEN, KV = 4, 64, 32
HEADER = {
    "name": "fsdp",
    "rank": RANK,
    "alpha": 8.0,
    "target_modules": ["q_proj", "v_proj"],
    "base": "tiny",
    "base_digest": "cd" * 16,
}


def config(store: str, role: str, rank: int, policy: int) -> Any:
    from refit_worker.contract.adapters import AdapterKnobs
    from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig

    return WorkerConfig(
        job="fsdp",
        role=role,
        rank=rank,
        policy_world_size=policy,
        rollout_world_size=1,
        pod_uid=str(uuid.uuid4()),
        pod_name=f"fsdp-{role}-{rank}",
        transfer=TransferConfig(
            bucket_size=16 << 10, timeout_seconds=60, refits=2, adapter=AdapterKnobs()
        ),
        rendezvous=RendezvousConfig(store="file", location=store),
    )


def lora_adapter() -> torch.nn.Module:
    """A module whose ``named_parameters()`` are PEFT's adapter state names and shapes."""
    root = torch.nn.Module()
    torch.manual_seed(0)
    for layer in range(2):
        for proj, out in (("q_proj", HIDDEN), ("v_proj", KV)):
            path = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            parent = root
            for part in path.split("."):
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            parent.add_module("lora_A", torch.nn.Linear(HIDDEN, RANK, bias=False))
            parent.add_module("lora_B", torch.nn.Linear(RANK, out, bias=False))
    return root


def policy_main(store: str, pg: str, rank: int, out_q: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from refit_worker import RefitSession
    from refit_worker.contract.adapters import AdapterHeader

    faulthandler.dump_traceback_later(0.95 * PATIENCE_S, exit=True)
    report: dict[str, Any] = {"role": "policy", "rank": rank, "refits": [], "collectives": []}
    dist.init_process_group("gloo", init_method=f"file://{pg}", rank=rank, world_size=2)
    adapter = lora_adapter()
    fully_shard(adapter, mesh=init_device_mesh("cpu", (2,)))
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=1e-2)
    session = RefitSession(config(store, "policy", rank, 2))
    header = AdapterHeader.model_validate(HEADER)
    try:
        report["dtensors"] = all(isinstance(p, DTensor) for p in adapter.parameters())
        session.connect()
        for refit in range(2):
            if refit:  # a real AdamW step on the sharded parameters
                loss = sum(((p - 1.0) ** 2).sum() for p in adapter.parameters())
                loss.backward()  # type: ignore[union-attr]
                optimizer.step()
                optimizer.zero_grad()
            counter = CollectiveCounter()
            with counter.counting():
                sent = list(adapter.named_parameters())
                stats = asyncio.run(session.send(sent, refit_id=refit, adapter=header))
            report.setdefault("bytes", []).append(stats.bytes)
            report["collectives"].append(counter.calls)
            full = {n: p.full_tensor().detach() for n, p in adapter.named_parameters()}
            report["refits"].append({n: digest(t) for n, t in full.items()})
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    with contextlib.suppress(Exception):
        session.close()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    out_q.put(json.dumps(report))
