"""Fixtures for the integration tier: the API emulator and kopf running in the test's loop.

Real: kopf, the operator's handlers, controller and HTTP client, aiohttp, the kubeconfig
loader.  Emulated: the Kubernetes API server (``tests/emulator``); there are no kubelets,
so tests move pods through their phases by patching ``/status`` the way a kubelet would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.emulator import ApiEmulator
from tests.support.operator_run import OperatorRun


@pytest.fixture()
async def kube_emulator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[ApiEmulator]:
    """The emulator, with ``KUBECONFIG`` pointing at it for this test."""
    async with ApiEmulator(tmp_path) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig_path))
        yield api


@pytest.fixture()
async def operator(kube_emulator: ApiEmulator) -> AsyncIterator[OperatorRun]:
    """The operator, started; stopped cleanly at the end of the test."""
    run = OperatorRun(resync_seconds=30.0)
    await run.start()
    try:
        yield run
    finally:
        await run.stop()
