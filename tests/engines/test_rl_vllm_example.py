"""``refit run examples/rl-vllm/job.yaml``: FSDP2 trainers refitting a vLLM rollout.

Real: ``refit run`` (the operator's rendering and reconcile, the process kubelet), two
policy ranks training a tiny Llama with FSDP2 on gloo (real AdamW steps on real tokens),
one rollout rank serving it with vLLM's CPU build, NIXL (UCX) transfers, the file-backed
rendezvous.  The pods' environment is what ``examples/rl-vllm/env.sh`` exports.  Nothing
is emulated; the check of every refit's tokens is made by the rollout itself, against
HF ``generate`` on that step's weights as the trainer computed it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.engines.environment import ROOT

EXAMPLE = ROOT / "examples" / "rl-vllm"
REFITS = 3
# An engine start plus its refits, on a loaded 2-core machine (the default is 300 s).
pytestmark = pytest.mark.timeout(1500)


def test_rl_example_refits_every_step_and_vllm_tokens_equal_hf(
    engine_python: Path, tmp_path: Path
) -> None:
    env = dict(os.environ)
    env.update(
        RL_VLLM_PYTHON=str(engine_python),
        RL_VLLM_DIR=str(EXAMPLE),
        PYTHONPATH=os.pathsep.join([str(ROOT / "worker"), str(ROOT / "operator")]),
    )
    workdir = tmp_path / "work"
    argv = [sys.executable, "-m", "refit_operator.cli", "run", str(EXAMPLE / "job.yaml")]
    done = subprocess.run(
        [*argv, "--plain", "--workdir", str(workdir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert f"refits {REFITS}/{REFITS}" in out and "restarts 0" in out
    assert "verification: tokens" in out
    (rollout_log,) = (workdir / "logs").glob("rl-vllm-rollout-0-*.log")
    checked = re.findall(
        r"refit (\d+): vLLM's greedy tokens equal HF generate's .*; transfer ([0-9.]+) s, "
        r"landing ([0-9.]+) s, verification ([0-9.]+) s",
        rollout_log.read_text(),
    )
    assert [int(c[0]) for c in checked] == list(range(REFITS))
    assert all(float(t) > 0 and float(land) > 0 for _, t, land, _ in checked)
    # The trainer really trained: each policy rank's loss fell over the steps.
    for log in (workdir / "logs").glob("rl-vllm-policy-*.log"):
        losses = [float(x) for x in re.findall(r"refit \d+: loss ([0-9.]+)", log.read_text())]
        assert len(losses) == REFITS and losses[-1] < losses[0], log.read_text()[-2000:]
