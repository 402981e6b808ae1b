"""Plays the kubelet between the API emulator and the process kubelet of ``refit run``.

Pods the operator creates in the emulator are started as local processes by
:class:`refit_operator.local.kubelet.ProcessKubelet` (the same code ``refit run`` uses);
their status goes back through ``/status`` the way a kubelet reports it.  Deletion is
graceful, as on a cluster: the bridge holds a finalizer on every pod it runs, and drops it
only once the process group is gone, so the operator sees the old pod until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tests.emulator import ApiEmulator
from tests.integration.support import OperatorRun

from refit_operator.local.kubelet import ProcessKubelet
from refit_operator.local.runner import LoopbackPorts, local_env

ROOT = Path(__file__).resolve().parents[2]
PODS = "v1/pods"
FINALIZER = "kubelet.refit.dev/process"


class KubeletBridge:
    def __init__(self, api: ApiEmulator, kubelet: ProcessKubelet, namespace: str = "default"):
        self.api, self.kubelet, self.namespace = api, kubelet, namespace
        #: pod name -> uid of the pod whose process runs (or ran) under that name.
        self.running: dict[str, str] = {}
        self._reported: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def exit_codes(self) -> dict[tuple[str, str], int]:
        """(pod name, uid) -> exit code of every process that ended."""
        return self.kubelet.exit_codes

    async def __aenter__(self) -> KubeletBridge:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self.kubelet.close, 30.0)

    async def _loop(self) -> None:
        while True:
            self.sync()
            await asyncio.sleep(0.1)

    def sync(self) -> None:
        local = {p["metadata"]["name"]: p for p in self.kubelet.pods()}
        for pod in self.api.list(PODS, self.namespace):
            meta = pod["metadata"]
            name, uid = meta["name"], meta["uid"]
            if meta.get("deletionTimestamp"):
                if self.running.get(name) == uid and name in local:
                    self.kubelet.delete(name, grace_seconds=_grace(pod))
                elif FINALIZER in (meta.get("finalizers") or []):
                    self.running.pop(name, None)
                    self._drop_finalizer(name)
            elif self.running.get(name) != uid:
                if name in local:
                    continue  # the previous pod of that name is still terminating
                self.api.patch(
                    PODS,
                    self.namespace,
                    name,
                    {"metadata": {"finalizers": [*meta.get("finalizers", []), FINALIZER]}},
                )
                self.kubelet.create(pod)
                self.running[name] = uid
            elif name in local:
                self._report(pod, local[name])

    def _report(self, pod: dict[str, Any], local: dict[str, Any]) -> None:
        status = dict(local["status"])
        name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
        # Keep conditions others wrote (DisruptionTarget from an eviction).
        ours = {c["type"] for c in status["conditions"]}
        status["conditions"] = status["conditions"] + [
            c for c in (pod.get("status") or {}).get("conditions", []) if c["type"] not in ours
        ]
        key = repr((uid, status["phase"], status["conditions"]))
        if self._reported.get(name) != key:
            self._reported[name] = key
            self.api.patch(PODS, self.namespace, name, {"status": status}, status=True)

    def _drop_finalizer(self, name: str) -> None:
        pod = self.api.find(PODS, self.namespace, name)
        if pod is None:
            return
        left = [f for f in pod["metadata"].get("finalizers", []) if f != FINALIZER]
        self.api.patch(PODS, self.namespace, name, {"metadata": {"finalizers": left}})


def _grace(pod: dict[str, Any]) -> float:
    return float(pod["spec"].get("terminationGracePeriodSeconds", 30))


@contextlib.asynccontextmanager
async def operator_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[ApiEmulator, KubeletBridge, OperatorRun]]:
    """The emulator, the operator in this loop, and the bridge running its pods locally."""
    async with ApiEmulator(tmp_path) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig_path))
        monkeypatch.setenv(
            "PYTHONPATH", os.pathsep.join([str(ROOT / "operator"), str(ROOT / "worker")])
        )
        ports = LoopbackPorts()
        kubelet = ProcessKubelet(
            tmp_path / "node", rewrite_env=lambda pod, env: local_env(env, port=ports.for_pod(pod))
        )
        run = OperatorRun(resync_seconds=30.0)
        await run.start()
        try:
            async with KubeletBridge(api, kubelet) as bridge:
                yield api, bridge, run
        finally:
            await run.stop()
