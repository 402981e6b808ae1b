"""Benchmark of the rendezvous: publish + barrier time, and bytes per rank, by job size.

For 8, 64, 256 and 1,024 ranks (half policy, half rollout), against the API emulator
(``tests/emulator``, the ConfigMap store) and a temporary directory (the file store):

- every rank publishes its metadata (16 threads play the ranks), while a coordinator
  waits for all of them and writes the barrier, and 8 sample ranks wait for the barrier
  and read their peers; the clock stops when the last sample rank has its peers;
- the baseline, measured in the same run: the same number of raw writes of the same bytes
  to the same backend (plain merge patches spread over as many ConfigMaps, plain file
  renames), with no protocol and no waiting.  The ratio says what the protocol costs
  over the writes it cannot avoid;
- bytes per rank: the ConfigMaps' (or files') total size over the ranks, and the shards.

Each figure is the median of ``--runs`` (>= 3) runs.  The metadata is a stand-in of the
NIXL engine's JSON of the measured size (451 raw bytes, base64, two buffer descriptors).

Run: ``python bench/rendezvous.py`` (or ``--quick`` for 8 and 64 ranks).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "worker"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from refit_worker.contract.rendezvous import (  # noqa: E402
    Layout,
    shards_needed,
)
from refit_worker.rendezvous import ConfigMapStore, FileStore, Member  # noqa: E402
from refit_worker.rendezvous.configmap_store import MERGE_PATCH, load_api_client  # noqa: E402
from refit_worker.rendezvous.store import RendezvousStore  # noqa: E402

SIZES = (8, 64, 256, 1024)
QUICK_SIZES = (8, 64)
PUBLISHERS = 16
SAMPLE_WAITERS = 8
CM = "v1/configmaps"
NS = "default"


def agent_json(rank: int) -> str:
    raw = os.urandom(451)
    return json.dumps(
        {
            "name": f"rank-{rank}",
            "metadata": base64.b64encode(raw).decode(),
            "buffers": [[140_000_000_000 + i * 67_108_864, 67_108_864, 0] for i in range(2)],
        }
    )


def members(total: int) -> list[Member]:
    half = total // 2
    return [Member("policy", r, 0, f"{r:08d}-0000-4000-8000-000000000000") for r in range(half)] + [
        Member("rollout", r, 0, f"{r:08d}-0000-4000-8000-00000000000{r % 10}")
        for r in range(total - half)
    ]


def run_protocol(make_store: Callable[[], RendezvousStore], total: int) -> float:
    """Seconds from the first publish until the sample ranks have their peers."""
    ranks = members(total)
    payloads = {(m.role, m.rank): agent_json(i) for i, m in enumerate(ranks)}
    stores = [make_store() for _ in range(PUBLISHERS)]
    coordinator, waiters = make_store(), [make_store() for _ in range(SAMPLE_WAITERS)]
    sample = ranks[:: max(1, total // SAMPLE_WAITERS)][:SAMPLE_WAITERS]

    def wait(i: int) -> int:
        store, me = waiters[i], sample[i]
        return len(store.peers(me, store.wait_barrier(me, timeout=300)))

    with ThreadPoolExecutor(PUBLISHERS + SAMPLE_WAITERS + 1) as pool:
        start = time.perf_counter()
        opened = pool.submit(coordinator.open_barrier, 0, 300)
        seen = [pool.submit(wait, i) for i in range(len(sample))]
        list(
            pool.map(
                lambda i: stores[i % PUBLISHERS].publish_metadata(
                    ranks[i], payloads[(ranks[i].role, ranks[i].rank)]
                ),
                range(total),
            )
        )
        opened.result()
        counts = [f.result() for f in seen]
        elapsed = time.perf_counter() - start
    if counts != [total] * len(sample):
        raise RuntimeError(f"sample ranks saw {counts} peers, expected {total} each")
    for store in [*stores, coordinator, *waiters]:
        store.close()
    return elapsed


def run_raw(write: Callable[[int, str], None], total: int) -> float:
    """Seconds for the same writes with no protocol: the floor the backend sets."""
    payloads = [agent_json(i) for i in range(total)]
    with ThreadPoolExecutor(PUBLISHERS) as pool:
        start = time.perf_counter()
        list(pool.map(lambda i: write(i, payloads[i]), range(total)))
        return time.perf_counter() - start


@contextmanager
def emulator() -> Iterator[Any]:
    """The API emulator served from its own event loop in a background thread."""
    from tests.emulator import ApiEmulator  # bench-only dependency

    ready, stop = threading.Event(), threading.Event()
    box: dict[str, Any] = {}

    async def serve() -> None:
        async with ApiEmulator(Path(tempfile.mkdtemp())) as api:
            box["api"], box["loop"] = api, asyncio.get_running_loop()
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the API emulator did not start within 30 s")
    os.environ["KUBECONFIG"] = str(box["api"].kubeconfig_path)
    try:
        yield box
    finally:
        stop.set()
        thread.join(10)


def on_loop(box: dict[str, Any], fn: Callable[[], Any]) -> Any:
    async def call() -> Any:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), box["loop"]).result(30)


def measure_configmap(total: int, run: int) -> tuple[float, float, float, int]:
    # A fresh emulator per run: its watches scan the whole write history on every write,
    # so one emulator kept across runs would slow each run down more than the last.
    with emulator() as box:
        return bench_configmap(box, total, run)


def bench_configmap(box: dict[str, Any], total: int, run: int) -> tuple[float, float, float, int]:
    api = box["api"]
    half = total // 2
    shards = shards_needed(half, total - half)
    layout = Layout(half, total - half, shards)
    base, raw_base = f"bench-{total}-{run}", f"raw-{total}-{run}"
    names = [layout.name(base, s) for s in range(shards)]
    raw_names = [layout.name(raw_base, s) for s in range(shards)]
    for name in names + raw_names:
        on_loop(box, lambda name=name: api.create(CM, NS, {"metadata": {"name": name}, "data": {}}))
    seconds = run_protocol(lambda: ConfigMapStore(base, NS, layout), total)
    size = sum(
        len(json.dumps(api.get(CM, NS, layout.name(base, s))).encode()) for s in range(shards)
    )
    from kubernetes import client  # after KUBECONFIG points at the emulator

    core = client.CoreV1Api(load_api_client())
    # Spread over as many ConfigMaps as the protocol uses: a map's size sets a write's cost.
    baseline = run_raw(
        lambda i, value: core.patch_namespaced_config_map(
            raw_names[i * shards // total],
            NS,
            {"data": {f"k{i}": value}},
            _content_type=MERGE_PATCH,
            _preload_content=False,
        ).release_conn(),
        total,
    )
    return seconds, baseline, size / total, shards


def bench_files(total: int) -> tuple[float, float, float, int]:
    half = total // 2
    shards = shards_needed(half, total - half)
    layout = Layout(half, total - half, shards)
    with tempfile.TemporaryDirectory() as tmp:
        seconds = run_protocol(lambda: FileStore(Path(tmp) / "rdzv", layout), total)
        size = sum(p.stat().st_size for p in (Path(tmp) / "rdzv").rglob("*") if p.is_file())
        raw = Path(tmp) / "raw"
        raw.mkdir()

        def write(i: int, value: str) -> None:
            part = raw / f".tmp-{i}"
            part.write_text(value)
            os.replace(part, raw / f"k{i}")

        baseline = run_raw(write, total)
    return seconds, baseline, size / total, shards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Figures are medians of --runs runs; the ratio "
        "is protocol time over raw-write time.",
    )
    parser.add_argument("--quick", action="store_true", help="only 8 and 64 ranks")
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (>= 3)")
    parser.add_argument("--ranks", type=int, nargs="*", help="job sizes (default 8 64 256 1024)")
    args = parser.parse_args(argv)
    if args.runs < 3:
        parser.error(f"--runs must be >= 3 (medians of at least 3 runs), got {args.runs}")
    sizes = tuple(args.ranks) if args.ranks else (QUICK_SIZES if args.quick else SIZES)
    bad = [n for n in sizes if n < 2]
    if bad:
        parser.error(f"--ranks must each be >= 2 (one policy and one rollout rank), got {bad}")
    print(
        f"{'store':<10}{'ranks':>6}{'shards':>7}{'publish+barrier s':>19}"
        f"{'per rank ms':>12}{'raw writes s':>13}{'ratio':>7}{'bytes/rank':>11}"
    )
    for label in ("configmap", "file"):
        for total in sizes:
            rows = [
                measure_configmap(total, run) if label == "configmap" else bench_files(total)
                for run in range(args.runs)
            ]
            seconds = statistics.median(r[0] for r in rows)
            baseline = statistics.median(r[1] for r in rows)
            per_rank = statistics.median(r[2] for r in rows)
            print(
                f"{label:<10}{total:>6}{rows[0][3]:>7}{seconds:>19.3f}"
                f"{seconds / total * 1e3:>12.2f}{baseline:>13.3f}"
                f"{seconds / baseline:>7.2f}{per_rank:>11.0f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
