"""``bench/refit_throughput.py`` runs and says what it measured, as JSON lines.

Real: the bench's own processes, real NIXL (UCX) and gloo, a small payload.  No timing is
asserted (timings belong to the bench, not to tests): only that every case ran, moved
bit-exact data where it checks, and reports the fields the lead's tooling reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = {
    "case": str,
    "topology": str,
    "bucket_mib": int,
    "gbps": float,
    "x_raw_nixl": float,
    "x_gloo": float,
    "raw_nixl_gbps": float,
    "gloo_gbps": float,
    "control_ms_cold": float,
    "control_ms_warm": float,
    "registrations_last": int,
}


def _ratio_of_rounded(ratio: float, num: float, den: float, digits: int) -> bool:
    """Whether ``ratio`` (printed to 3 decimals) is ``num / den`` of the unrounded figures,
    given that both were printed to ``digits`` decimals: the ratio must lie in the interval
    the rounding leaves open (a fixed tolerance flaked once, on a 14 ms run)."""
    half = 0.5 * 10**-digits
    low = (num - half) / (den + half)
    high = (num + half) / (den - half) if den > half else float("inf")
    return low - 0.0005 <= ratio <= high + 0.0005


def test_quick_bench_emits_one_valid_json_line_per_case() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "refit_throughput.py"),
            "--quick",
            "--runs",
            "1",
            "--json",
            "--buckets",
            "1",
            "--topologies",
            "1x1,2x2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    cases = sorted((line["case"], line["topology"]) for line in lines)
    assert cases == sorted(
        (case, topo)
        for case in ("engine", "session", "session-in-place")
        for topo in ("1x1", "2x2")
    )
    for line in lines:
        for key, kind in REQUIRED.items():
            assert isinstance(line[key], kind), (key, line)
        assert line["bucket_mib"] == 1 and line["gbps"] > 0
        assert _ratio_of_rounded(line["x_raw_nixl"], line["gbps"], line["raw_nixl_gbps"], 3)
        if line["case"].startswith("session"):
            assert line["verified"] is True, line  # every rollout ended with the sent bytes
            assert line["registrations_last"] == 0, line  # reused after the warm-up
    assert "raw NIXL" in done.stdout and "x raw" in done.stdout  # the human table too


def _quick_bench(script: str) -> subprocess.CompletedProcess[str]:
    """``bench/<script> --quick --runs 1 --json``, which must succeed."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick", "--runs", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_quick_sharded_bench_compares_with_gather_then_send() -> None:
    """``bench/sharded_send.py``: both cases ran, the ratio is theirs, the rollout is exact."""
    done = _quick_bench("sharded_send.py")
    (line,) = [json.loads(row) for row in done.stdout.splitlines() if row.startswith("{")]
    assert line["case"] == "sharded-send" and line["topology"] == "2x1"
    assert line["verified"] is True, line  # the rollout ended bit-exact with the model
    assert line["sharded_s"] > 0 and line["gather_s"] > 0
    assert _ratio_of_rounded(line["x_gather"], line["gather_s"], line["sharded_s"], 4), line
    assert len(line["sharded_runs_s"]) == len(line["gather_runs_s"]) == 1
    assert "ratio: gather-then-send takes" in done.stdout


def test_the_peer_seed_bench_measures_a_seed_against_a_raw_read() -> None:
    """``bench/peer_seed.py``: a verified seed striped over two peer processes, and its
    baselines (a raw NIXL READ of the same bytes, a memcpy), measured in the same run."""
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "peer_seed.py"),
            "--mib",
            "8",
            "--peers",
            "2",
            "--runs",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["peers"] == 2 and figures["bytes"] >= 8 << 20, figures
    for key in ("seed_s", "raw_read_s", "memcpy_s", "x_raw", "x_memcpy", "gbps"):
        assert isinstance(figures[key], float) and figures[key] > 0, (key, figures)


def test_the_delta_bench_measures_a_delta_against_a_whole_refit() -> None:
    """``bench/delta_refit.py``: an FSDP2 AdamW run's bf16 weights sent both as deltas and
    whole to real rollout processes; every case went as a delta of the changes the bench
    counted, both rollouts ended bit-exact, and the ratio is the two timings'."""
    done = _quick_bench("delta_refit.py")
    lines = [json.loads(row) for row in done.stdout.splitlines() if row.startswith("{")]
    assert sorted(line["lr"] for line in lines) == [1e-6, 1e-5], lines
    for line in lines:
        assert line["verified"] is True, line  # both rollouts ended with the trainer's bits
        assert line["runs"] == 1 and line["model_mib"] > 0, line
        assert 0 < line["changed_fraction"] < 1, line
        (changed,) = line["changed_elements_runs"]
        assert line["changed_fraction"] == round(changed / line["elements"], 6), line
        assert line["all_delta"] is True and line["delta_bytes"] < line["whole_bytes"], line
        # What went on the wire is the changes the bench counted: an int32 index and a bf16
        # value per changed element, each section 8-byte aligned, per tensor and rank's
        # block, each rank's piece whole words.
        ranks = line["policy_ranks"]
        slack = 16 * line["tensors"] * ranks + 8 * ranks
        assert 6 * changed <= line["delta_bytes"] <= 6 * changed + slack, line
        assert "no gather" in line["sender"], line  # the ranks sent their own shards
        assert line["whole_bytes"] == 2 * line["elements"], line
        assert line["delta_s"] > 0 and line["whole_s"] > 0, line
        assert _ratio_of_rounded(line["x_full"], line["whole_s"], line["delta_s"], 4), line
    # A larger learning rate changes more of the bf16 weights.
    low, high = sorted(lines, key=lambda line: line["lr"])
    assert low["changed_fraction"] < high["changed_fraction"], lines
    assert "delta bytes / whole bytes" in done.stdout and "x_full" in done.stdout
