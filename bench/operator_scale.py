"""Scale check: a RefitJob of 64 policy + 64 rollout ranks against the API emulator.

Measures, per run, (a) apply -> every child created, and (b) all pods patched Running ->
status shows 64/64 ready on both roles.  The baseline, measured in the same run with the
same HTTP client and emulator, is writing the same children straight to the API (no
operator), and patching the same pod statuses; the ratios say what the operator adds.
Prints medians of N runs (default 3).  Usage: ``python bench/operator_scale.py [runs]``.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "operator"), str(ROOT / "worker")]

from tests.emulator import ApiEmulator  # noqa: E402
from tests.support.operator_run import JOBS, NS, PODS, OperatorRun, load_job  # noqa: E402

from refit_operator.api.models import parse_spec  # noqa: E402
from refit_operator.render.children import render_static  # noqa: E402
from refit_operator.render.pods import JobRef, RenderOptions, render_gang  # noqa: E402
from refit_operator.shell.kube import Kube  # noqa: E402

RANKS = 64
TIMEOUT_S = 300.0


async def _wait(check: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline, delay = loop.time() + TIMEOUT_S, 0.01
    while not check():
        if loop.time() > deadline:
            raise TimeoutError(f"waited {TIMEOUT_S}s for {what}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)


def _running(api: ApiEmulator) -> None:
    for pod in api.list(PODS, NS):
        status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        api.patch(PODS, NS, pod["metadata"]["name"], {"status": status}, status=True)


async def operator_run() -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        async with ApiEmulator(Path(tmp)) as api:
            os.environ["KUBECONFIG"] = str(api.kubeconfig_path)
            op = OperatorRun(resync_seconds=600.0)
            await op.start()
            try:
                job = load_job("big", policy={"replicas": RANKS}, rollout={"replicas": RANKS})
                t0 = time.perf_counter()
                api.create(JOBS, NS, job)
                await _wait(lambda: len(api.list(PODS, NS)) == 2 * RANKS, "all pods")
                created = time.perf_counter() - t0
                t1 = time.perf_counter()
                _running(api)

                def all_ready() -> bool:
                    st = api.get(JOBS, NS, "big").get("status") or {}
                    return st.get("phase") == "Running" and st["rollout"]["ready"] == RANKS

                await _wait(all_ready, "status Running with every pod ready")
                return created, time.perf_counter() - t1
            finally:
                await op.stop()


async def baseline_run() -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        async with ApiEmulator(Path(tmp)) as api:
            kube = Kube(api.url)
            spec = parse_spec(
                load_job("big", policy={"replicas": RANKS}, rollout={"replicas": RANKS})["spec"]
            )
            ref = JobRef("big", NS, "uid-0")
            objs = render_static(ref, spec) + render_gang(ref, spec, 0, RenderOptions())
            t0 = time.perf_counter()
            for obj in objs:
                await kube.create(obj)
            created = time.perf_counter() - t0
            t1 = time.perf_counter()
            _running(api)
            patched = time.perf_counter() - t1
            await kube.close()
            return created, patched


async def main(runs: int) -> None:
    op, base = [], []
    for _ in range(runs):
        base.append(await baseline_run())
        op.append(await operator_run())
    med = [statistics.median(x[i] for x in op) for i in range(2)]
    ref = [statistics.median(x[i] for x in base) for i in range(2)]
    print(f"RefitJob {RANKS}+{RANKS} ranks against the emulator, median of {runs} runs")
    print(
        f"  apply -> all children created:  operator {med[0]:.3f}s  direct writes {ref[0]:.3f}s"
        f"  ratio {med[0] / ref[0]:.2f}x"
    )
    print(
        f"  pods Running -> status 64/64:   operator {med[1]:.3f}s  status patches {ref[1]:.3f}s"
        f"  ratio {med[1] / ref[1]:.2f}x"
    )


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3))
