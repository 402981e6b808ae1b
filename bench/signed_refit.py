"""What signing costs a refit: the same refits with and without the job's key, same run.

Two processes (a policy and a rollout ``NIXLCheckpointEngine``, integrity hashes on as in
every job) move a bf16 transformer-shaped state of ``--gib`` GiB over NIXL (UCX), first
unsigned, then with the job's Ed25519 key (the policy seals every target's manifest and
piece hashes, the rollout verifies before it commits).  Printed, as medians of ``--runs``
timed refits after warm-up:

* the refit's seconds unsigned and signed, and their ratio;
* the seconds spent sealing (policy) and verifying (rollout) per refit, as a share of the
  signed refit: the cost the key adds, measured where it is spent;
* a raw NIXL WRITE of the same bytes between two processes, the link's pace here.

    python bench/signed_refit.py --gib 1 --runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _refit_ranks import CTX, WAIT_S, bench_raw_nixl, state_dict

WARMUP = 2
SEED = bytes(range(32))  # the bench's job key (both processes derive the same halves)


def _shape(gib: float) -> tuple[int, int, int]:
    """(layers, hidden, vocab) of about ``gib`` GiB of bf16 weights."""
    hidden, vocab = 2048, 32000
    per_layer = (4 * hidden * hidden + 2 * hidden * (hidden * 2 // 3) + hidden) * 2
    layers = max(1, round((gib * (1 << 30) - vocab * hidden * 2) / per_layer))
    return layers, hidden, vocab


def _rank(
    role: str, shape: tuple[int, int, int], signed: bool, runs: int, q_in: Any, q_out: Any, res: Any
) -> None:
    from refit_worker.engine import NIXLCheckpointEngine, RefitTiming
    from refit_worker.engine.messages.signing import RefitSigner, RefitVerifier

    key = RefitSigner(SEED)
    keys: dict[str, Any] = {}
    if signed:
        keys = {"signer": key} if role == "policy" else {"verifier": RefitVerifier(key.public)}
    engine = NIXLCheckpointEngine(64 << 20, device="cpu", checksum=True, **keys)
    mine = engine.prepare().model_dump_json()
    q_out.put(mine)
    theirs = q_in.get(timeout=WAIT_S)
    metadata = [mine, theirs] if role == "policy" else [theirs, mine]
    timings: list[RefitTiming] = []
    if role == "policy":
        engine.init_policy_process_group(
            worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata
        )
        state = state_dict(*shape)
        for _ in range(WARMUP + runs):
            timings.append(asyncio.run(engine.send_weights(iter(state.items()))))
    else:
        engine.init_rollout_process_group(
            rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata
        )

        async def drain() -> None:
            async for _batch in engine.receive_weight_batches(on_complete=timings.append):
                pass

        for _ in range(WARMUP + runs):
            asyncio.run(drain())
    engine.finalize()
    kept = timings[WARMUP:]
    res.put(
        json.dumps(
            {
                "role": role,
                "seconds": [t.seconds for t in kept],
                "seal_s": [t.seal_s for t in kept],
                "signed_by": [t.signed_by for t in kept],
                "bytes": kept[-1].bytes,
            }
        )
    )


def run_case(shape: tuple[int, int, int], signed: bool, runs: int) -> dict[str, Any]:
    """One policy and one rollout process; both ranks' figures."""
    q_p, q_r, res = CTX.Queue(), CTX.Queue(), CTX.Queue()
    procs = [
        CTX.Process(target=_rank, args=("policy", shape, signed, runs, q_r, q_p, res)),
        CTX.Process(target=_rank, args=("rollout", shape, signed, runs, q_p, q_r, res)),
    ]
    for proc in procs:
        proc.start()
    out = {}
    for _ in procs:
        report = json.loads(res.get(timeout=WAIT_S))
        out[report["role"]] = report
    for proc in procs:
        proc.join(timeout=60)
        if proc.exitcode != 0:
            raise RuntimeError(f"a {proc.name} rank exited {proc.exitcode}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of weights per refit")
    parser.add_argument("--runs", type=int, default=5, help="timed refits per case (median)")
    args = parser.parse_args(argv)
    if not 0 < args.gib <= 64 or args.runs < 1:
        parser.error("--gib takes (0, 64], --runs at least 1")
    shape = _shape(args.gib)
    unsigned = run_case(shape, signed=False, runs=args.runs)
    signed = run_case(shape, signed=True, runs=args.runs)
    nbytes = signed["policy"]["bytes"]
    raw = statistics.median(bench_raw_nixl(nbytes, args.runs, "cpu"))
    if any(s is None for s in signed["rollout"]["signed_by"]):
        raise RuntimeError("a signed refit was committed without its seals checked")
    med = statistics.median
    t_unsigned = med(unsigned["policy"]["seconds"])
    t_signed = med(signed["policy"]["seconds"])
    sign_s = med(signed["policy"]["seal_s"])
    verify_s = med(signed["rollout"]["seal_s"])
    print(
        f"signed refit: {nbytes / (1 << 30):.2f} GiB, {args.runs} timed refits per case "
        "(medians), 1 policy -> 1 rollout process, integrity hashes on"
    )
    print(f"  raw NIXL WRITE of the same bytes  {raw:8.3f} s  ({nbytes / raw / 1e9:.2f} GB/s)")
    print(
        f"  refit unsigned                    {t_unsigned:8.3f} s  "
        f"({t_unsigned / raw:.2f}x raw NIXL)"
    )
    print(
        f"  refit signed                      {t_signed:8.3f} s  "
        f"({t_signed / t_unsigned:.3f}x unsigned)"
    )
    print(f"  sealing (policy) per refit        {sign_s * 1e3:8.3f} ms")
    print(f"  verifying (rollout) per refit     {verify_s * 1e3:8.3f} ms")
    print(f"  seal cost / signed refit          {(sign_s + verify_s) / t_signed:8.4%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
