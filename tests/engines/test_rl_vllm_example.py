"""``refit run examples/rl-vllm/job.yaml`` (and ``rl-vllm-lora``): FSDP2 trainers refitting
a vLLM rollout (the LoRA one: only its adapter).

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


def _run_example(name: str, engine_python: Path, tmp_path: Path) -> tuple[str, Path]:
    """``refit run examples/<name>/job.yaml`` with env.sh's variables; its summary (the
    job succeeded) and its logs directory."""
    env = dict(os.environ)
    env.update(
        RL_VLLM_PYTHON=str(engine_python),
        RL_VLLM_DIR=str(EXAMPLE),
        PYTHONPATH=os.pathsep.join([str(ROOT / "worker"), str(ROOT / "operator")]),
    )
    workdir = tmp_path / "work"
    job = ROOT / "examples" / name / "job.yaml"
    argv = [sys.executable, "-m", "refit_operator.cli", "run", str(job)]
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
    return out, workdir / "logs"


def _losses_fell(logs: Path, job: str) -> None:
    """The trainer really trained: each policy rank's loss fell over the steps."""
    for log in logs.glob(f"{job}-policy-*.log"):
        losses = [float(x) for x in re.findall(r"refit \d+: loss ([0-9.]+)", log.read_text())]
        assert len(losses) == REFITS and losses[-1] < losses[0], log.read_text()[-2000:]


def test_rl_example_refits_every_step_and_vllm_tokens_equal_hf(
    engine_python: Path, tmp_path: Path
) -> None:
    out, logs = _run_example("rl-vllm", engine_python, tmp_path)
    assert "verification: tokens" in out
    (rollout_log,) = logs.glob("rl-vllm-rollout-0-*.log")
    checked = re.findall(
        r"refit (\d+): vLLM's greedy tokens equal HF generate's .*; transfer ([0-9.]+) s, "
        r"landing ([0-9.]+) s, verification ([0-9.]+) s",
        rollout_log.read_text(),
    )
    assert [int(c[0]) for c in checked] == list(range(REFITS))
    assert all(float(t) > 0 and float(land) > 0 for _, t, land, _ in checked)
    _losses_fell(logs, "rl-vllm")


def test_lora_example_refits_only_the_adapter_and_vllm_answers_hf_peft(
    engine_python: Path, tmp_path: Path
) -> None:
    """examples/rl-vllm-lora: 2 FSDP2 ranks of a PEFT LoRA, each sending its own shards of
    the adapter; every refit served as a new version whose tokens and logprobs are HF +
    PEFT's (checked by the rollout before it commits), the version before it unloaded."""
    out, logs = _run_example("rl-vllm-lora", engine_python, tmp_path)
    assert "verification: tokens" in out
    (rollout_log,) = logs.glob("rl-vllm-lora-rollout-0-*.log")
    served = re.findall(
        r"refit (\d+): (\S+) serves HF \+ PEFT's greedy tokens \(logprob gap (\S+)\), "
        r"(\d+) LoRA modules read back; .*; loaded \[(.*?)\]",
        rollout_log.read_text(),
    )
    assert [int(s[0]) for s in served] == list(range(REFITS)), rollout_log.read_text()[-3000:]
    for k, version, gap, modules, loaded in served:
        assert version == f"rl-lora-v{k}" and loaded == f"'{version}'"  # keep: 1
        assert float(gap) <= 1e-3 and int(modules) == 6  # 2 layers x q, v, down
    # Each rank sent its own shards of the adapter, never the whole of it: rank 4 on
    # q (4x128 + 128x4), v (4x128 + 64x4), down (4x256 + 128x4) of 2 layers, float32.
    adapter = 2 * 4 * (4 * 128 + 128 * 4 + 4 * 128 + 64 * 4 + 4 * 256 + 128 * 4)
    sent = [
        [int(b) for b in re.findall(r"sent (\d+) adapter bytes", log.read_text())]
        for log in logs.glob("rl-vllm-lora-policy-*.log")
    ]
    assert len(sent) == 2 and all(len(s) == REFITS for s in sent), sent
    for mine, theirs in zip(*sent, strict=True):
        assert 0 < mine < adapter and 0 < theirs < adapter
        assert adapter <= mine + theirs < adapter + 4096, (mine, theirs)
    _losses_fell(logs, "rl-vllm-lora")
