"""The README's signal-handler example runs as written.

Real: the code block after ``<!-- signal-example -->`` in README.md, run as a script in
its own process, stopped by ``os.kill``; its checkpoint read back with safetensors.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

from refit_worker.contract.exits import EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[2]


def _example() -> str:
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- signal-example -->\n```python\n(.*?)```", readme, re.DOTALL)
    assert found, "README.md has no python block after <!-- signal-example -->"
    return found.group(1)


def test_readme_training_loop_saves_and_exits_on_the_signal(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_example())
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "worker"), env.get("PYTHONPATH")]))
    env["REFIT_PREEMPTION_SIGNAL"] = "SIGUSR1, sigterm"
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        readable, _, _ = select.select([proc.stdout], [], [], 90)
        assert readable, "the example did not start training within 90s"
        assert proc.stdout.readline().strip() == "rank 0: training"
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == EXIT_PREEMPTED
    saved = re.fullmatch(r"rank 0: preempted at step (\d+), checkpoint saved\n", out)
    assert saved, out
    with safe_open(str(tmp_path / "rank0.safetensors"), framework="pt") as checkpoint:
        assert checkpoint.metadata() == {"step": saved.group(1)}
        assert sorted(checkpoint.keys()) == ["bias", "weight"]
