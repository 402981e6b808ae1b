"""The engines tier's environment: the cached vLLM venv and the env of engine processes.

:func:`install` runs ``tests/engines/install.sh`` (makes or reuses the vLLM environment);
:func:`engine_env` is the environment an engine-side subprocess runs with (this
checkout's ``worker/`` on ``PYTHONPATH``: kube-refit is not installed into the cached
environment, so it can never run a stale copy).  Used by the tier's conftest and by the
cluster tier's RL example test.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import yaml

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


def plugin_dir() -> Path:
    """A directory holding only kube-refit's distribution metadata (its entry points, read
    from pyproject.toml), for ``PYTHONPATH``.

    vLLM loads ``vllm.general_plugins`` in every process it starts (the engine core, its
    workers) from installed distributions' entry points; the sources on ``PYTHONPATH`` alone
    have none, so a process vLLM spawned would not know the ``kube-refit`` backend.  This is
    what ``pip install kube-refit`` would put there, without installing a copy of the code.
    """
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = project.get("entry-points", {})
    metadata = f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    points = "".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in items.items())
        for group, items in groups.items()
    )
    key = hashlib.sha256((str(ROOT) + points).encode()).hexdigest()[:12]
    where = Path(tempfile.gettempdir()) / f"kube-refit-plugin-{key}"
    info = where / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(metadata)
    (info / "entry_points.txt").write_text(points)
    return where


def engine_env(**extra: str) -> dict[str, str]:
    """The environment of an engine-side subprocess: this checkout's worker and tests, and
    kube-refit's entry points (:func:`plugin_dir`)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "worker"), str(ROOT), str(plugin_dir())])
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def example_pod_env(venv: Path) -> list[dict[str, str]]:
    """The env of the RL examples' pods on process nodes: the vLLM environment's Python,
    the examples' directory, this checkout's worker and kube-refit's entry points on
    ``PYTHONPATH`` (what an image from docker/Dockerfile.vllm has built in)."""
    return [
        {"name": "RL_VLLM_PYTHON", "value": str(venv / "bin" / "python")},
        {"name": "RL_VLLM_DIR", "value": str(ROOT / "examples" / "rl-vllm")},
        {"name": "PYTHONPATH", "value": os.pathsep.join([str(ROOT / "worker"), str(plugin_dir())])},
    ]


def example_manifest(example: str, venv: Path, path: Path, **rollout_env: str) -> dict[str, Any]:
    """``examples/<example>/job.yaml`` with :func:`example_pod_env` on both roles (and
    ``rollout_env`` on the rollout, replacing the example's values), written to ``path``;
    the document."""
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / example / "job.yaml").read_text())
    for role, extra in (("policy", {}), ("rollout", rollout_env)):
        env = [*example_pod_env(venv), *({"name": k, "value": v} for k, v in extra.items())]
        names = {e["name"] for e in env}
        spec = doc["spec"][role]
        spec["env"] = [*(e for e in spec.get("env", []) if e["name"] not in names), *env]
    path.write_text(yaml.safe_dump(doc))
    return doc
