"""Peer seeding against its hardware baseline: a new rollout rank READs a peer's committed
copy (:func:`refit_worker.engine.rollout.seed_transfer.pull`: the manifest, the striped READs,
every tensor's hash checked), against a raw NIXL READ of the same bytes between the same
two processes (one descriptor list, nothing checked) and a local memcpy, measured in the
same run.

The peers are child processes holding a synthetic bf16 state of about ``--mib`` MiB,
offered as a rollout rank offers its commit; each polls its NIXL worker every millisecond,
as a rank waiting inside ``receive()`` does (over UCX's TCP transport a READ needs that).

Run: ``python bench/peer_seed.py [--mib 256] [--peers 1] [--runs 5] [--json]``.  Prints
medians of ``--runs``; ``x_raw`` is the seed's seconds over the raw READ's (1.0: no cost
beyond moving the bytes), ``gbps`` the seed's bytes over its seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

import torch

from refit_worker.engine.base import dtype_from_name
from refit_worker.engine.messages.wire import NixlAgentMetadata
from refit_worker.engine.planning.buckets import TensorSpec
from refit_worker.engine.rollout.seed_transfer import SeedOffer, SeedSource, _Reader, pull
from refit_worker.engine.transport.agent import NixlAgent
from refit_worker.engine.transport.registry import MemoryRegistry, device_id

LAYER_SHAPES = ((4096, 4096), (4096, 4096), (11008, 4096))  # ~2 x 32 MiB + 86 MiB in bf16


def state_of(mib: int) -> dict[str, torch.Tensor]:
    """A bf16 state of about ``mib`` MiB in transformer-like tensors, deterministic."""
    gen = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    total, layer = 0, 0
    while total < mib << 20:
        for i, shape in enumerate(LAYER_SHAPES):
            t = torch.randn(shape, generator=gen).to(torch.bfloat16)
            state[f"layers.{layer}.w{i}"] = t
            total += t.numel() * 2
        layer += 1
    return state


def serve(mib: int) -> None:
    """The peer: offer the state, print where, poll NIXL until stdin closes."""
    state = state_of(mib)
    agent = NixlAgent()
    offer = SeedOffer(agent, MemoryRegistry(agent, "DRAM"), torch.device("cpu"))
    offer.publish(1, state)
    assert offer.pointer is not None
    region, metadata = offer.pointer
    print(
        json.dumps(
            {
                "agent": agent.get_agent_metadata().model_dump_json(),
                "region": list(region),
                "metadata": base64.b64encode(metadata).decode(),
            }
        ),
        flush=True,
    )
    while True:
        agent.poll()
        if select.select([sys.stdin], [], [], 0.001)[0] and not sys.stdin.readline():
            return


async def _raw_read(
    agent: NixlAgent,
    peer: str,
    local: Sequence[tuple[int, int, int]],
    remote: Sequence[tuple[int, int, int]],
) -> float:
    started = time.perf_counter()
    await agent.read(
        peer, local, remote, "DRAM", what="the raw baseline", deadline=time.monotonic() + 120
    )
    return time.perf_counter() - started


def _fresh(specs: Sequence[TensorSpec]) -> Mapping[str, torch.Tensor]:
    return {s.name: torch.empty(s.shape, dtype=dtype_from_name(s.dtype)) for s in specs}


async def measure(sources: list[SeedSource], runs: int) -> dict[str, float]:
    agent = NixlAgent()
    registry = MemoryRegistry(agent, "DRAM")
    seeds, raws, copies = [], [], []
    targets: dict[str, torch.Tensor] = {}

    def resolve(specs: Sequence[TensorSpec]) -> Mapping[str, torch.Tensor]:
        if not targets:
            targets.update(_fresh(specs))
        return targets

    nbytes = 0
    for _ in range(runs):
        seeded = await pull(
            agent,
            registry,
            torch.device("cpu"),
            sources,
            min_refit=0,
            resolve=resolve,
            timeout_s=120,
        )
        seeds.append(seeded.seconds)
        nbytes = seeded.bytes
    # The baseline: the same bytes, READ from the first peer into the same targets, as one
    # list of regions (its landing set, read back from its manifest by the seed above).
    reader = _Reader(agent, registry, torch.device("cpu"))
    manifest = await reader.manifest(sources[0], time.monotonic() + 30)
    where = {t.name: t for t in manifest.landing.tensors}
    local = [(t.data_ptr(), t.numel() * t.element_size(), device_id(t)) for t in targets.values()]
    remote = [(where[n].addr, where[n].nbytes, where[n].dev_id) for n in targets]
    for _ in range(runs):
        raws.append(await _raw_read(agent, sources[0].agent.agent_name, local, remote))
    flat = torch.empty(nbytes, dtype=torch.uint8)
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    for _ in range(runs):
        started = time.perf_counter()
        flat.copy_(src)
        copies.append(time.perf_counter() - started)
    seed_s, raw_s, copy_s = (statistics.median(x) for x in (seeds, raws, copies))
    return {
        "bytes": nbytes,
        "seed_s": seed_s,
        "raw_read_s": raw_s,
        "memcpy_s": copy_s,
        "x_raw": seed_s / raw_s,
        "x_memcpy": seed_s / copy_s,
        "gbps": nbytes / seed_s / 1e9,
    }


def _peer(mib: int) -> tuple[subprocess.Popen[str], SeedSource]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--mib", str(mib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            offer = json.loads(line)
            break
    else:
        raise SystemExit(f"the peer exited (rc {proc.wait()})")
    source = SeedSource(
        f"rollout-{proc.pid}",
        NixlAgentMetadata.model_validate_json(offer["agent"]),
        tuple(offer["region"]),  # type: ignore[arg-type]
        base64.b64decode(offer["metadata"]),
    )
    return proc, source


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    parser.add_argument("--peers", type=int, default=1, help="peers to stripe over (default 1)")
    parser.add_argument("--runs", type=int, default=5, help="runs per figure (median; default 5)")
    parser.add_argument("--json", action="store_true", help="one JSON line instead of text")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.mib)
        return 0
    peers = [_peer(args.mib) for _ in range(args.peers)]
    try:
        figures = asyncio.run(measure([s for _, s in peers], args.runs))
    finally:
        for proc, _ in peers:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=60)
    figures["peers"] = args.peers
    if args.json:
        print(json.dumps(figures))
    else:
        print(
            f"seed of {figures['bytes'] / 2**20:.0f} MiB from {args.peers} peer(s): "
            f"{figures['seed_s']:.3f} s ({figures['gbps']:.2f} GB/s), raw NIXL READ "
            f"{figures['raw_read_s']:.3f} s, memcpy {figures['memcpy_s']:.3f} s: "
            f"x_raw {figures['x_raw']:.2f}, x_memcpy {figures['x_memcpy']:.2f} "
            f"(medians of {args.runs})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
