"""The engines tier's environment: the cached vLLM venv and the env of engine processes.

:func:`install` runs ``tests/engines/install.sh`` (makes or reuses the vLLM environment);
:func:`engine_env` is the environment an engine-side subprocess runs with (this
checkout's ``worker/`` on ``PYTHONPATH``: kube-refit is not installed into the cached
environment, so it can never run a stale copy).  Used by the tier's conftest and by the
cluster tier's RL example test.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
INSTALL_TIMEOUT_S = 1800


def install() -> Path:
    """The vLLM environment's directory (install.sh's stdout); RuntimeError with its
    stderr when it fails."""
    done = subprocess.run(
        ["bash", str(HERE / "install.sh")],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"tests/engines/install.sh failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
        )
    return Path(done.stdout.strip().splitlines()[-1])


def engine_env(**extra: str) -> dict[str, str]:
    """The environment of an engine-side subprocess: this checkout's worker and tests."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "worker"), str(ROOT)])
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env
