"""Delta refits against whole refits: the same training step's weights sent both ways, in ONE run.

A real FSDP2 training run: two policy processes (``torch.distributed`` on gloo,
``fully_shard`` per layer and at the root) train a stack of residual ``Linear`` layers
(~1 GiB of parameters in bf16 by default, initialised N(0, 0.02) as a pretrained
transformer's weights are scaled) with AdamW on a synthetic regression (random inputs,
a fixed random teacher, seeded), one case per learning rate (``--lrs``, default 1e-6 and
1e-5).  As in RL trainers with mixed precision, the optimiser keeps float32 master weights
and state and the refit sends the weights cast to bf16: a step's update is much smaller
than a bf16 ulp, so only the elements whose master value crossed a bf16 rounding boundary
change bits.  That share, ``changed_fraction`` (elements whose bf16 bits differ from the
previous step's bf16 weights), is measured by the bench itself on every step.

After every step each policy rank casts its own shards to bf16 (DTensors kept across
steps, as a trainer's parameters; no gather) and both ranks send that step's weights
through two :class:`~refit_worker.PolicySession` s each, every session to a
:class:`~refit_worker.RolloutSession` in its own process (real NIXL over UCX, file
rendezvous store, integrity hashes on, the sessions' defaults otherwise).  Each rank writes
only its own blocks:

* ``delta``: ``transfer.delta: on``: each rank finds the changed elements of its own
  blocks (int32 index + value), the ranks agree on one delta when it is at most half the
  bytes, and each writes its piece; the rollout applies them onto a spare copy of the
  version it serves, checks every block's hash against the trainer's, then commits and
  confirms;
* ``whole`` (the baseline): ``transfer.delta`` off: every refit is the whole weights.

Each send is timed on policy rank 0 from the ``send`` call to its return (every receiver
confirmed the refit complete, verified and committed), as ``bench/refit_throughput.py``
times it; the two sessions go in alternating order.  The delta's time includes the work a
delta costs on top of the bytes: each policy rank compares its blocks with the last refit,
hashes them and keeps a copy, and the ranks exchange their offers; the rollout copies the
served version into its spare, scatters the changes and hashes every block of the result.
The bytes are both ranks' (summed outside the timing).  The first refit of a case
(the initial weights) and the first ``WARMUP_STEPS`` training steps are refitted but not
timed (AdamW's first steps move every weight by the full learning rate; buffers are
allocated and registered); every figure is the median of the ``--runs`` timed steps after them.
``x_full`` = whole seconds / delta seconds (>1: the delta is faster); ``rollout s`` is what
the rollout ranks' ``RefitStats.seconds`` report (transfer + apply + commit).  At the end of
each case both rollouts' committed weights are checked bit-exact against the trainer's bf16
weights (``tensors_digest`` of the full weights, gathered for that only, outside the timing;
reported back as JSON files).

``--json`` adds one JSON line per case (``case``, ``lr``, ``changed_fraction``, ``x_full``,
``delta_s``, ``whole_s``, ``delta_bytes``, ``whole_bytes``, ``model_mib``, ``verified``,
``runs``, ...).  ``--quick``: a ~2 MiB model, one timed step per case (for the test).
``--layers``/``--hidden`` set the model's size; ``--tcp`` sets ``UCX_TLS=tcp`` for the child
processes (the cross-pod case: no shared memory, so fewer bytes matter more).

Usage: ``python bench/delta_refit.py [--runs 3] [--lrs 1e-6,1e-5] [--quick] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))

import torch

CTX = mp.get_context("spawn")
WAIT_S = 600.0
#: Training steps refitted (both ways) but not timed, after the initial weights' refit.
WARMUP_STEPS = 3
#: Rows of random inputs per policy rank and step.
BATCH = 16
INIT_STD = 0.02
FULL = (32, 4096)  # layers x hidden: 512 Mi parameters, 1 GiB of bf16
QUICK = (4, 512)  # 1 Mi parameters, 2 MiB of bf16
SESSIONS = ("delta", "whole")
POLICY_RANKS = 2


class Stack(torch.nn.Module):
    """Residual blocks ``x + tanh(W x)``: every layer gets a gradient at any depth."""

    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


def build(layers: int, hidden: int) -> Stack:
    """The same float32 model on every rank (seeded), sharded with FSDP2 over the ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Stack(layers, hidden)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, INIT_STD)
    mesh = init_device_mesh("cpu", (POLICY_RANKS,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _config(name: str, role: str, job: dict[str, Any], rank: int = 0) -> Any:
    from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig

    return WorkerConfig(
        job=f"delta-bench-{name}",
        role=role,
        rank=rank,
        policy_world_size=POLICY_RANKS,  # every trainer rank sends its own shards
        rollout_world_size=1,
        pod_uid=str(uuid.uuid4()),
        pod_name=f"delta-bench-{name}-{role}-{rank}",
        transfer=TransferConfig(
            delta="on" if name == "delta" else None,
            timeout_seconds=WAIT_S,
            refits=job["refits"],
        ),
        rendezvous=RendezvousConfig(store="file", location=job["stores"][name]),
        termination_message_path=str(Path(job["tmp"]) / f"{name}-{role}-{rank}.termination"),
    )


def _logging(who: str, verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format=f"[{who}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.int16)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's block of a DTensor (a plain tensor is its own)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def policy(rank: int, job: dict[str, Any]) -> None:
    """One FSDP2 trainer rank: it sends its own shards of every step's bf16 weights."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from refit_worker import PolicySession
    from refit_worker.engine.messages.integrity import tensors_digest

    _logging(f"policy-{rank}", job["verbose"])
    dist.init_process_group(
        "gloo",
        init_method=f"file://{job['pg']}",
        rank=rank,
        world_size=POLICY_RANKS,
        timeout=timedelta(seconds=WAIT_S),
    )
    loop = asyncio.new_event_loop()
    sessions: dict[str, PolicySession] = {}
    for name in SESSIONS:  # both ranks connect in the same order (the gang's collectives)
        sessions[name] = PolicySession(_config(name, "policy", job, rank))
        sessions[name].connect()
    layers, hidden = job["shape"]
    teacher = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(7)) / hidden**0.5
    # This rank's bf16 shards as sent: the same DTensors every step (a trainer's parameters),
    # and the last step's local bits (to count what changed, untimed).
    weights: dict[str, torch.Tensor] = {}
    last: dict[str, torch.Tensor] = {}
    report: dict[str, Any] = {"cases": []}
    refit = 0
    for lr in job["lrs"]:
        model = build(layers, hidden)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        data = torch.Generator().manual_seed(1000 + rank)
        case: dict[str, Any] = {"lr": lr, "steps": []}
        for step in range(1 + WARMUP_STEPS + job["runs"]):
            if step:  # step 0 refits the initial weights
                x = torch.randn(BATCH, hidden, generator=data)
                loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ teacher))
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                optimizer.zero_grad()
            changed = 0
            with torch.no_grad():  # untimed: a local cast, no collective
                for name, param in model.named_parameters():
                    if name not in weights:
                        weights[name] = param.detach().to(torch.bfloat16)
                    else:
                        weights[name].copy_(param.detach())
                    local = _local(weights[name])
                    if name in last and step:
                        changed += int((_bits(local) != _bits(last[name])).sum())
                    last[name] = local.clone()
            record: dict[str, Any] = {"refit": refit, "timed": step > WARMUP_STEPS}
            order = SESSIONS if step % 2 == 0 else SESSIONS[::-1]
            for name in order:
                started = time.perf_counter()
                stats = loop.run_until_complete(
                    sessions[name].send(weights.items(), refit_id=refit)
                )
                record[name] = {
                    "seconds": time.perf_counter() - started,
                    "bytes": stats.bytes,
                    "stats_s": stats.seconds,
                    "registrations": stats.registrations,
                    "delivered": sorted(stats.delivered),
                }
            # Untimed: both ranks' bytes and changed elements (rank 0 reports the sums).
            sums = torch.tensor(
                [changed, record["delta"]["bytes"], record["whole"]["bytes"]], dtype=torch.int64
            )
            dist.all_reduce(sums)
            record["changed"] = int(sums[0])
            record["delta"]["bytes"], record["whole"]["bytes"] = int(sums[1]), int(sums[2])
            case["steps"].append(record)
            refit += 1
            dist.barrier()
        with torch.no_grad():  # untimed: the full weights, for the bit-exact check only
            full = {n: w.full_tensor() if isinstance(w, DTensor) else w for n, w in weights.items()}
        if rank == 0:
            case["digest"] = tensors_digest(full)
            case["elements"] = sum(t.numel() for t in full.values())
            case["tensors"] = len(full)
            case["whole_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
            report["cases"].append(case)
        del model, optimizer, full
        weights.clear()
        last.clear()
    for session in sessions.values():
        session.close()
    loop.close()
    if rank == 0:
        Path(job["tmp"], "policy.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def rollout(name: str, job: dict[str, Any]) -> None:
    """A rollout rank of session ``name``: receives every refit; the committed state's digest
    at the end of each case."""
    from refit_worker import RolloutSession
    from refit_worker.engine.messages.integrity import tensors_digest

    _logging(f"rollout-{name}", job["verbose"])
    session = RolloutSession(_config(name, "rollout", job))
    session.connect()
    loop = asyncio.new_event_loop()
    per_case = 1 + WARMUP_STEPS + job["runs"]
    report: dict[str, Any] = {"refits": [], "digests": []}
    for refit in range(job["refits"]):
        stats = loop.run_until_complete(session.receive(refit_id=refit))
        report["refits"].append(
            {"refit": stats.refit_id, "bytes": stats.bytes, "seconds": stats.seconds}
        )
        if refit % per_case == per_case - 1:  # the case's last refit (untimed from here)
            committed = session.committed
            report["digests"].append(tensors_digest(committed.state) if committed else "")
    session.close()
    loop.close()
    Path(job["tmp"], f"rollout-{name}.json").write_text(json.dumps(report))


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Start the ranks, open both jobs' barriers, wait for every rank; their reports."""
    from refit_worker.contract.rendezvous import Layout
    from refit_worker.rendezvous import FileStore, RendezvousTimeout

    stores = [FileStore(Path(job["stores"][name]), Layout(POLICY_RANKS, 1, 1)) for name in SESSIONS]
    procs = [CTX.Process(target=policy, args=(rank, job)) for rank in range(POLICY_RANKS)]
    procs += [CTX.Process(target=rollout, args=(name, job)) for name in SESSIONS]
    deadline = time.monotonic() + job["wait_s"]

    def check() -> None:  # a rank that died stops the bench (the others would wait)
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed:
            hint = (
                " (-9: SIGKILL, usually the kernel's OOM killer: each policy rank holds its "
                "fp32 weights, gradients and AdamW state plus two bf16 copies; try --layers 16)"
                if -9 in failed
                else ""
            )
            raise RuntimeError(f"a bench rank failed (exit codes {failed}){hint}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the bench's ranks did not finish in {job['wait_s']:g}s")

    for proc in procs:
        proc.start()
    try:
        for store in stores:  # once every rank of the job published, as the operator does
            while True:
                try:
                    store.open_barrier(0, timeout=2.0)
                    break
                except RendezvousTimeout:
                    check()
        while any(p.is_alive() for p in procs):
            check()
            time.sleep(0.2)
        check()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=60)
    tmp = Path(job["tmp"])
    return {
        "policy": json.loads((tmp / "policy.json").read_text()),
        **{name: json.loads((tmp / f"rollout-{name}.json").read_text()) for name in SESSIONS},
    }


def _line(
    index: int, case: dict[str, Any], reports: dict[str, Any], job: dict[str, Any]
) -> dict[str, Any]:
    """One case's figures from the ranks' reports."""
    elements, whole_bytes = case["elements"], case["whole_bytes"]
    timed = [s for s in case["steps"] if s["timed"]]
    received = {name: {r["refit"]: r for r in reports[name]["refits"]} for name in SESSIONS}
    delta_s = statistics.median(s["delta"]["seconds"] for s in timed)
    whole_s = statistics.median(s["whole"]["seconds"] for s in timed)
    fractions = [s["changed"] / elements for s in timed]
    digests = {reports[name]["digests"][index] for name in SESSIONS}
    return {
        "case": f"adamw-lr{case['lr']:g}",
        "lr": case["lr"],
        "model_mib": round(whole_bytes / 2**20, 2),
        "elements": elements,
        "tensors": case["tensors"],
        "changed_fraction": round(statistics.median(fractions), 6),
        # every step after the initial weights, warm-up steps first
        "changed_fraction_steps": [round(s["changed"] / elements, 6) for s in case["steps"][1:]],
        "changed_elements_runs": [s["changed"] for s in timed],
        "delta_bytes": int(statistics.median(s["delta"]["bytes"] for s in timed)),
        "whole_bytes": whole_bytes,
        "delta_bytes_runs": [s["delta"]["bytes"] for s in timed],
        "whole_bytes_runs": [s["whole"]["bytes"] for s in timed],
        # every timed refit went as a delta (fewer bytes than the whole weights)
        "all_delta": all(s["delta"]["bytes"] < whole_bytes for s in timed),
        "delta_s": round(delta_s, 4),
        "whole_s": round(whole_s, 4),
        "x_full": round(whole_s / delta_s, 3),
        "delta_runs_s": [round(s["delta"]["seconds"], 4) for s in timed],
        "whole_runs_s": [round(s["whole"]["seconds"], 4) for s in timed],
        "rollout_delta_s": round(
            statistics.median(received["delta"][s["refit"]]["seconds"] for s in timed), 4
        ),
        "rollout_whole_s": round(
            statistics.median(received["whole"][s["refit"]]["seconds"] for s in timed), 4
        ),
        "registrations_timed": max(s[name]["registrations"] for s in timed for name in SESSIONS),
        "verified": digests == {case["digest"]},
        "runs": job["runs"],
        "warmup_steps": WARMUP_STEPS,
        "policy_ranks": POLICY_RANKS,
        "sender": f"{POLICY_RANKS} FSDP2 ranks, each its own bf16 shards (no gather)",
        "ucx_tls": os.environ.get("UCX_TLS", "default"),
        "load_1m": job["load_1m"],
    }


def _size(nbytes: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes:.0f} B"


HEADER = (
    f"{'case':<15} {'lr':>7} {'changed':>8} {'delta bytes / whole bytes':>29} "
    f"{'delta s':>8} {'whole s':>8} {'x_full':>7} {'rollout s delta/whole':>22}  verified"
)


def _row(line: dict[str, Any]) -> str:
    share = line["delta_bytes"] / line["whole_bytes"]
    sizes = f"{_size(line['delta_bytes'])} / {_size(line['whole_bytes'])} ({100 * share:.1f}%)"
    mark = "" if line["all_delta"] else "  (some went whole)"
    rollout = f"{line['rollout_delta_s']:.4f}/{line['rollout_whole_s']:.4f}"
    return (
        f"{line['case']:<15} {line['lr']:>7.0e} {100 * line['changed_fraction']:>7.2f}% "
        f"{sizes:>29} {line['delta_s']:>8.4f} {line['whole_s']:>8.4f} {line['x_full']:>7.2f} "
        f"{rollout:>22}  {line['verified']}{mark}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--runs", type=int, default=None, help="timed steps per case (median)")
    parser.add_argument("--lrs", default="1e-6,1e-5", help="learning rates, one case each")
    parser.add_argument("--quick", action="store_true", help="a ~2 MiB model, 1 run (tests)")
    parser.add_argument("--json", action="store_true", help="also one JSON line per case")
    parser.add_argument("--layers", type=int, default=None, help="Linear layers (default 32)")
    parser.add_argument("--hidden", type=int, default=None, help="layer width (default 4096)")
    parser.add_argument("--tcp", action="store_true", help="UCX_TLS=tcp in the child processes")
    parser.add_argument("--verbose", action="store_true", help="the ranks' INFO logs on stderr")
    args = parser.parse_args(argv)
    runs = args.runs if args.runs is not None else (1 if args.quick else 3)
    if runs < 1:
        parser.error(f"--runs must be >= 1, got {runs}")
    try:
        lrs = [float(x) for x in args.lrs.split(",") if x]
    except ValueError:
        parser.error(f"--lrs: comma-separated numbers, got {args.lrs!r}")
    if not lrs or any(lr <= 0 for lr in lrs):
        parser.error(f"--lrs: positive learning rates, got {args.lrs!r}")
    layers, hidden = QUICK if args.quick else FULL
    layers, hidden = args.layers or layers, args.hidden or hidden
    if layers < 1 or hidden < POLICY_RANKS:
        parser.error(f"--layers must be >= 1 and --hidden >= {POLICY_RANKS}")
    if args.tcp:
        os.environ["UCX_TLS"] = "tcp"
    load = os.getloadavg()
    print(
        f"delta vs whole refit: FSDP2 AdamW on {POLICY_RANKS} gloo ranks, float32 master "
        f"weights, {layers} x {hidden}x{hidden} = {layers * hidden * hidden * 2 / 2**20:.0f} "
        f"MiB sent as bf16 shards, each rank its own (no gather) -> 1 rollout per session; "
        f"{WARMUP_STEPS} warm-up steps + {runs} timed steps per case (medians), "
        f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}, "
        f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="refit-delta-bench-") as tmp:
        job = {
            "shape": (layers, hidden),
            "lrs": lrs,
            "runs": runs,
            "refits": len(lrs) * (1 + WARMUP_STEPS + runs),
            "tmp": tmp,
            "pg": str(Path(tmp) / "pg"),
            "stores": {name: str(Path(tmp) / f"store-{name}") for name in SESSIONS},
            "verbose": args.verbose,
            "wait_s": WAIT_S * len(lrs),
            "load_1m": round(load[0], 2),
        }
        reports = run(job)
    lines = [_line(i, case, reports, job) for i, case in enumerate(reports["policy"]["cases"])]
    print(HEADER)
    for line in lines:
        print(_row(line))
    print(
        "x_full = whole s / delta s (>1: the delta refit is faster); changed: elements whose "
        "bf16 bits changed in the step; rollout s: RefitStats.seconds on the rollouts"
    )
    if args.json:
        for line in lines:
            print(json.dumps(line, sort_keys=True), flush=True)
    return 0 if all(line["verified"] for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
