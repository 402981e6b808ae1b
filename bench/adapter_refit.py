"""Adapter refits against whole refits of the same model: bytes and seconds, in ONE run.

The model: a Llama-shaped state dict (``--layers``, ``--hidden``, ``--intermediate``,
``--vocab``; bf16, seeded random values), and a PEFT LoRA adapter of rank ``--rank`` on
every projection of every layer (q, k, v, o, gate, up, down: PEFT's names and shapes).
Two jobs run one after the other in this process, each a real ``PolicySession`` sending
to a real ``RolloutSession`` (inside a ``StagedReceiver`` on its own thread) over NIXL
(UCX), file rendezvous, integrity hashes on:

* ``whole`` (the baseline): every refit is the model's whole weights, staged and committed;
* ``adapter``: ``transfer.adapter`` set; every refit is the adapter's tensors with its
  header, landed by ``AdapterLanding`` (header and base digest checked, the adapter written
  as PEFT files to the tmpfs) with the vLLM load left out (no engine here: what vLLM's
  ``add_lora`` adds is in docs/adapters.md from the engines tier).

Each refit is timed from ``send`` to its return (the rollout confirmed it committed); the
first refit of each job is not timed (registrations); figures are medians of ``--runs``.
``x_bytes`` and ``x_seconds`` = whole / adapter.  The load (``os.getloadavg``) is printed
with the figures.

Usage: ``python bench/adapter_refit.py [--runs 5] [--quick] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from refit_worker.contract.adapters import AdapterHeader, AdapterKnobs
from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig
from refit_worker.contract.roles import Role
from refit_worker.contract.shards import Layout
from refit_worker.integrations.staged import StagedReceiver
from refit_worker.integrations.vllm.adapter_landing import AdapterLanding
from refit_worker.policy.policy_session import PolicySession
from refit_worker.rendezvous import FileStore
from refit_worker.rollout.rollout_session import RolloutSession

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DIGEST = "ab" * 16


def shapes(layers: int, hidden: int, inter: int, vocab: int) -> dict[str, tuple[int, int]]:
    """``module path -> (out, in)`` of every projection, and the model's other tensors."""
    found: dict[str, tuple[int, int]] = {"model.embed_tokens": (vocab, hidden)}
    for i in range(layers):
        for proj in PROJECTIONS:
            part = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            out, inn = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden)}.get(
                proj, (hidden, inter) if proj == "down_proj" else (hidden, hidden)
            )
            found[f"model.layers.{i}.{part}.{proj}"] = (out, inn)
    found["lm_head"] = (vocab, hidden)
    return found


def whole_state(layout: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        f"{path}.weight": torch.randn(shape, generator=gen).to(torch.bfloat16)
        for path, shape in layout.items()
    }


def adapter_state(layout: dict[str, tuple[int, int]], rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    state = {}
    for path, (out, inn) in layout.items():
        if path.rsplit(".", 1)[-1] in PROJECTIONS:
            base = f"base_model.model.{path}"
            state[f"{base}.lora_A.weight"] = torch.randn(rank, inn, generator=gen).bfloat16()
            state[f"{base}.lora_B.weight"] = torch.randn(out, rank, generator=gen).bfloat16()
    return state


def _config(store: Path, role: Role, refits: int, adapter: bool) -> WorkerConfig:
    return WorkerConfig(
        job="bench",
        role=role,
        rank=0,
        policy_world_size=1,
        rollout_world_size=1,
        pod_uid=str(uuid.uuid4()),
        pod_name=f"bench-{role}-0",
        transfer=TransferConfig(
            bucket_size=64 << 20,
            timeout_seconds=300,
            refits=refits,
            adapter=AdapterKnobs() if adapter else None,
        ),
        rendezvous=RendezvousConfig(store="file", location=str(store)),
        termination_message_path=str(store.parent / f"{role}.termination"),
    )


def run_job(
    tmp: Path, state: dict[str, torch.Tensor], refits: int, rank: int | None
) -> dict[str, Any]:
    """Send ``state`` ``refits`` times; per refit the policy's seconds and bytes."""
    store_dir = tmp / ("adapter" if rank else "whole")
    store = FileStore(store_dir, Layout(1, 1, 1))
    receiver = StagedReceiver(RolloutSession(_config(store_dir, "rollout", refits, bool(rank))))
    header = None
    landing: AdapterLanding | None = None
    if rank is not None:
        targets = PROJECTIONS
        header = AdapterHeader(
            name="bench", rank=rank, alpha=2.0 * rank, target_modules=targets, base="b",
            base_digest=DIGEST,
        )  # fmt: skip
        landing = AdapterLanding(
            receiver, adapter="bench", keep=1, base="b", base_digest=DIGEST,
            load=lambda *_: None, unload=lambda _: None,
        )  # fmt: skip
    policy = PolicySession(_config(store_dir, "policy", refits, bool(rank)))
    sent: list[tuple[float, int]] = []

    def send() -> None:
        policy.connect()
        for k in range(refits):
            started = time.perf_counter()
            stats = asyncio.run(policy.send(state.items(), refit_id=k, adapter=header))
            sent.append((time.perf_counter() - started, stats.bytes))

    thread = threading.Thread(target=send, daemon=True)
    try:
        (landing or receiver).begin(0)
        thread.start()
        store.open_barrier(0, timeout=120)
        for k in range(refits):
            if k:
                (landing or receiver).begin(k)
            if landing is not None:
                landing.land(300)
                landing.commit()
            else:
                receiver.staged(300)
                receiver.commit(landing_s=0.0)
        thread.join(300)
    finally:
        receiver.close()
        policy.close()
    timed = sent[1:]
    return {
        "seconds": statistics.median(s for s, _ in timed),
        "bytes": timed[0][1],
        "runs": len(timed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed refits per job (median)")
    parser.add_argument("--quick", action="store_true", help="a ~10 MiB model (for smoke runs)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="also one JSON line")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    if args.quick:
        args.layers, args.hidden, args.intermediate, args.vocab = 2, 256, 512, 4096
    layout = shapes(args.layers, args.hidden, args.intermediate, args.vocab)
    whole, adapter = whole_state(layout), adapter_state(layout, args.rank)
    with tempfile.TemporaryDirectory(prefix="adapter-bench-") as tmp:
        base = run_job(Path(tmp), whole, args.runs + 1, None)
        lora = run_job(Path(tmp), adapter, args.runs + 1, args.rank)
    load = os.getloadavg()
    result: dict[str, Any] = {
        "model_mib": base["bytes"] / 2**20,
        "rank": args.rank,
        "whole_bytes": base["bytes"],
        "adapter_bytes": lora["bytes"],
        "whole_s": base["seconds"],
        "adapter_s": lora["seconds"],
        "x_bytes": base["bytes"] / lora["bytes"],
        "x_seconds": base["seconds"] / lora["seconds"],
        "runs": base["runs"],
        "load": [round(x, 2) for x in load],
    }
    print(
        f"model {result['model_mib']:.1f} MiB bf16, LoRA rank {args.rank} on all 7 projections,"
        f" {result['runs']} timed refits (medians), load {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f} on {os.cpu_count()} cores\n"
        f"  whole:   {base['bytes'] / 2**20:9.2f} MiB  {base['seconds']:.4f} s\n"
        f"  adapter: {lora['bytes'] / 2**20:9.2f} MiB  {lora['seconds']:.4f} s\n"
        f"  x_bytes {result['x_bytes']:.1f}  x_seconds {result['x_seconds']:.1f} (whole / adapter)",
        flush=True,
    )
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
