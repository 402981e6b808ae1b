"""``refit operator`` as a real process: it finds the API through KUBECONFIG, serves the
liveness probe, reconciles, and stops cleanly on SIGTERM.

Real: the console entry point in a subprocess, kopf, signals.  Emulated: the API server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
from tests.emulator import ApiEmulator
from tests.integration.support import JOBS, NS, PODS, eventually, load_job
from tests.support.processes import free_port

ROOT = Path(__file__).resolve().parents[2]


async def test_operator_process_reconciles_and_answers_liveness(
    kube_emulator: ApiEmulator,
) -> None:
    port = free_port()
    env = {
        **os.environ,
        "KUBECONFIG": str(kube_emulator.kubeconfig_path),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "worker")]),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "refit_operator.cli",
        "operator",
        "--namespace",
        NS,
        "--liveness",
        f"http://127.0.0.1:{port}/healthz",
        "--stop-signal-supported",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        kube_emulator.create(JOBS, NS, load_job(preemption={"signal": "SIGUSR2"}))
        await eventually(lambda: len(kube_emulator.list(PODS, NS)) == 4, "4 pods", timeout=60)
        pod = kube_emulator.get(PODS, NS, "demo-policy-0")
        # injection auto + --stop-signal-supported -> the kubelet's stop signal
        assert pod["spec"]["containers"][0]["lifecycle"] == {"stopSignal": "SIGUSR2"}

        url = f"http://127.0.0.1:{port}/healthz"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert response.status == 200
            probes = await response.json()
        assert probes["reconciles"] >= 1

        def annotations() -> dict[str, str]:
            meta = kube_emulator.get(JOBS, NS, "demo")["metadata"]
            return {k: v for k, v in (meta.get("annotations") or {}).items() if "refit.dev/" in k}

        # kopf keeps its handler state under our prefix, not kopf.zalando.org.
        await eventually(annotations, "kopf's annotations under the refit.dev/ prefix")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, stderr.decode()[-2000:]
