"""Refit throughput: the engine and the session path against memcpy, raw NIXL and gloo, in ONE run.

Every number is a median of ``--runs`` timed refits (after two warm-up refits) measured in
this run, and every case is printed as a ratio to the baselines measured at the start of
the same run (so load from other processes skews both alike; the load average is printed):

* memcpy: ``torch`` copy of the payload size inside one process;
* raw NIXL: one registered buffer of the payload size WRITTEN between two processes
  (post -> DONE), the ceiling for any NIXL transfer of that payload;
* gloo: ``torch.distributed`` send/recv of the payload between two processes;
* ``engine``: ``NIXLCheckpointEngine`` alone, upstream's views API, no integrity hashes; the
  consumer only counts the yielded views (upstream leaves the copy to it);
* ``session``: what users run: ``RefitSession.receive`` with its defaults (integrity hashes
  on, double-buffered straight into the session's final tensors, committed by a swap), over
  the file rendezvous store;
* ``session-in-place``: ``RefitSession.receive_into(state, mode="in_place")``, into the live
  tensors, integrity on;
* ``session-no-integrity`` (only when named): ``session`` without the hashes, to show
  what integrity costs.

Cases are timed on the policy rank: from the call that sends a refit to its return (every
receiver confirmed it complete and verified).  ``rollout GB/s`` is what the rollout ranks
report per refit (``RefitStats``: transfer + commit, as ``refit run`` shows them); ``ctl ms``
the control work per refit (plans, registrations, route set-up) on the policy rank, cold
(first refit) / warm (median of the timed ones); ``regs`` the NIXL registrations made in
the last refit on any rank (0: all reused); ``cpu s tx/rx`` the CPU seconds per refit that
the policy / rollout ranks used (all threads; on a busy host, work competes for cores).
For 2x2 the rate is the total over both pairs.

``--json`` adds one JSON line per case (``case``, ``topology``, ``bucket_mib``, ``gbps``,
``x_raw_nixl``, ``x_gloo``, ...) after the table.  ``--tcp`` sets ``UCX_TLS=tcp`` for the
child processes (the cross-pod case: no CMA).  ``--device cuda`` moves the payload, the
receive memory and the raw NIXL baseline to the GPU (gloo stays on CPU).

Usage: ``python bench/refit_throughput.py [--runs 3] [--quick] [--json] [--device cuda]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))

import torch

from _refit_ranks import (
    CASES,
    EXTRA_CASES,
    bench_engine,
    bench_gloo,
    bench_memcpy,
    bench_raw_nixl,
    meta_state_dict,
    state_dict,
)

FULL_SHAPE = (24, 2048, 32000)  # ~1.12 GiB of bf16
QUICK_SHAPE = (2, 256, 4096)


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def _median_rate(moved: int, seconds: list[float]) -> float:
    return moved / statistics.median(seconds) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--runs", type=int, default=3, help="timed refits per case (median)")
    parser.add_argument(
        "--quick", action="store_true", help="a small payload (~3 MiB), for smoke runs"
    )
    parser.add_argument("--tcp", action="store_true", help="UCX_TLS=tcp in the child processes")
    parser.add_argument(
        "--buckets", default=None, help="bucket sizes in MiB (default 16,64,256; --quick: 1,4)"
    )
    parser.add_argument("--topologies", default="1x1,2x2", help="policy x rollout ranks")
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated, of {', '.join(CASES + EXTRA_CASES)}",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", action="store_true", help="also one JSON line per case")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES + EXTRA_CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {list(CASES + EXTRA_CASES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    if args.tcp:
        os.environ["UCX_TLS"] = "tcp"
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    buckets = [int(x) for x in (args.buckets or ("1,4" if args.quick else "16,64,256")).split(",")]
    size = nbytes(state_dict(*shape) if args.quick else meta_state_dict(shape))
    load = os.getloadavg()
    print(
        f"payload {size / 2**20:.0f} MiB bf16, device {args.device}, {args.runs} timed refits "
        f"per case (medians), UCX_TLS={os.environ.get('UCX_TLS', '(default)')}, "
        f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores",
        flush=True,
    )
    base = {
        "memcpy": _median_rate(size, bench_memcpy(size, args.runs, args.device)),
        "raw NIXL": _median_rate(size, bench_raw_nixl(size, args.runs, args.device)),
        "gloo": _median_rate(size, bench_gloo(size, args.runs)),
    }
    for name, value in base.items():
        print(f"{name:>10}: {value:6.2f} GB/s", flush=True)
    head = (
        f"{'case':>17} {'topo':>4} {'bucket':>7} {'GB/s':>6} {'x raw':>6} {'x gloo':>6} "
        f"{'x memcpy':>8} {'rollout GB/s':>12} {'ctl ms cold/warm':>16} {'regs':>4} "
        f"{'cpu s tx/rx':>11}"
    )
    print(head, flush=True)
    lines = []
    with tempfile.TemporaryDirectory(prefix="refit-bench-") as tmp:
        for topo in args.topologies.split(","):
            train, rollout = (int(x) for x in topo.split("x"))
            for mib in buckets:
                for case in cases:
                    cfg = {
                        "case": case,
                        "train": train,
                        "rollout": rollout,
                        "bucket": mib << 20,
                        "runs": args.runs,
                        "shape": shape,
                        "device": args.device,
                        "store": str(Path(tmp) / f"{case}-{topo}-{mib}"),
                    }
                    result = bench_engine(cfg)
                    moved = size * max(train, rollout) if train <= rollout else size * rollout
                    line = _line(case, topo, mib, moved, result, base, args, load)
                    lines.append(line)
                    print(_row(line), flush=True)
    if args.json:
        for line in lines:
            print(json.dumps(line, sort_keys=True), flush=True)
    return 0 if all(line["verified"] is not False for line in lines) else 1


def _line(
    case: str,
    topo: str,
    mib: int,
    moved: int,
    result: dict[str, Any],
    base: dict[str, float],
    args: argparse.Namespace,
    load: tuple[float, float, float],
) -> dict[str, Any]:
    rate = _median_rate(moved, result["seconds"])
    rollout = result.get("rollout_seconds")
    control = result["control_s"]
    return {
        "case": case,
        "topology": topo,
        "bucket_mib": mib,
        "gbps": round(rate, 3),
        "x_raw_nixl": round(rate / base["raw NIXL"], 3),
        "x_gloo": round(rate / base["gloo"], 3),
        "x_memcpy": round(rate / base["memcpy"], 3),
        "raw_nixl_gbps": round(base["raw NIXL"], 3),
        "gloo_gbps": round(base["gloo"], 3),
        "memcpy_gbps": round(base["memcpy"], 3),
        "rollout_gbps": round(_median_rate(moved, rollout), 3) if rollout else None,
        "control_ms_cold": round(control[0] * 1e3, 2),
        "control_ms_warm": round(statistics.median(control[1:]) * 1e3, 2),
        "registrations_last": result["registrations"][-1],
        "cpu_s_policy": round(result["cpu_policy"], 3),
        "cpu_s_rollout": round(result["cpu_rollout"], 3),
        "verified": result.get("verified"),
        "runs": args.runs,
        "payload_bytes": moved,
        "device": args.device,
        "ucx_tls": os.environ.get("UCX_TLS", "default"),
        "load_1m": round(load[0], 2),
    }


def _row(line: dict[str, Any]) -> str:
    rollout = f"{line['rollout_gbps']:.2f}" if line["rollout_gbps"] else "-"
    control = f"{line['control_ms_cold']:.1f}/{line['control_ms_warm']:.1f}"
    mark = "" if line["verified"] is not False else "  NOT BIT-EXACT"
    return (
        f"{line['case']:>17} {line['topology']:>4} {line['bucket_mib']:>4}MiB "
        f"{line['gbps']:6.2f} {line['x_raw_nixl']:6.2f} {line['x_gloo']:6.2f} "
        f"{line['x_memcpy']:8.2f} {rollout:>12} {control:>16} "
        f"{line['registrations_last']:>4} "
        f"{line['cpu_s_policy']:5.2f}/{line['cpu_s_rollout']:<5.2f}{mark}"
    )


if __name__ == "__main__":
    sys.exit(main())
