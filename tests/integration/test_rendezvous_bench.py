"""The rendezvous benchmark runs end to end at a tiny size and prints its table.

Real: the benchmark script as a separate process, its API emulator, both stores.
Nothing is timed or compared here; only that every row is produced and well-formed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from refit_worker.contract.rendezvous import MAX_META_BYTES

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "rendezvous.py"


def test_bench_prints_a_row_per_store_and_size() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--ranks", "4", "6", "--runs", "3"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].split()[:2] == ["store", "ranks"]
    rows = [line.split() for line in lines[1:]]
    # Three shards at these sizes: the operator's map, then one map per role.
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("configmap", "4", "3"),
        ("configmap", "6", "3"),
        ("file", "4", "3"),
        ("file", "6", "3"),
    ]
    for row in rows:
        seconds, ratio, per_rank_bytes = float(row[3]), float(row[6]), int(row[7])
        assert seconds > 0 and ratio > 0
        assert 500 < per_rank_bytes < MAX_META_BYTES  # one metadata entry each, under its limit


def test_bench_refuses_too_few_runs_and_ranks() -> None:
    for args, message in (
        (["--runs", "2"], "--runs must be >= 3"),
        (["--ranks", "1"], "--ranks must each be >= 2"),
    ):
        done = subprocess.run(
            [sys.executable, str(BENCH), *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            check=False,
        )
        assert done.returncode == 2
        assert message in done.stderr
