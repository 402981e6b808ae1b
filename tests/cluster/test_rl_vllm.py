"""The RL example on the real control plane: FSDP2 trainers refit a vLLM rollout.

``kubectl apply`` of ``examples/rl-vllm/job.yaml`` with the env its pods need on these
process nodes (the cached vLLM environment's Python, the example's directory, this
checkout's worker on PYTHONPATH: what an image from docker/Dockerfile.vllm has built in);
kube-scheduler places the gang, the pods rendezvous over the job's ConfigMaps with their
own ServiceAccount tokens, two policy ranks train with FSDP2 on gloo, the rollout serves
with vLLM's CPU build and checks vLLM's greedy tokens against the trainer's HF ``generate``
after every refit before committing it (``verification: tokens``).

Real: everything but the kubelet (process nodes) and the pod network (loopback).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tests.cluster.support import EXAMPLES, REPO_ROOT, Cluster, Install
from tests.engines.environment import install as install_engine_env

NS = "rl"


@pytest.mark.timeout(1500)
def test_rl_vllm_example_refits_every_step_with_tokens_checked(
    cluster: Cluster, install: Install, tmp_path: Path
) -> None:
    venv = install_engine_env()  # cached after the engines tier (or CI's install step)
    doc = yaml.safe_load((EXAMPLES / "rl-vllm" / "job.yaml").read_text())
    env = [
        {"name": "RL_VLLM_PYTHON", "value": str(venv / "bin" / "python")},
        {"name": "RL_VLLM_DIR", "value": str(EXAMPLES / "rl-vllm")},
        {"name": "PYTHONPATH", "value": str(REPO_ROOT / "worker")},
    ]
    for role in ("policy", "rollout"):
        doc["spec"][role]["env"] = [*doc["spec"][role].get("env", []), *env]
    manifest = tmp_path / "rl-vllm.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    cluster.namespace(NS)
    cluster.kubectl.ok("apply", "-n", NS, "-f", str(manifest))
    name = doc["metadata"]["name"]
    cluster.kubectl.ok(
        "wait",
        "--for=condition=Complete",
        f"rj/{name}",
        "-n",
        NS,
        "--timeout=1200s",
        timeout=1230,
    )
    status = cluster.job_status(NS, name)
    assert status["phase"] == "Succeeded", status
    assert status["refitsCompleted"] == doc["spec"]["transfer"]["refits"]
    assert status["verification"] == "tokens", status
    assert (status["restarts"], status["preemptions"]) == (0, 0)
    codes = cluster.gang_exit_codes(NS, name, 0)
    assert len(codes) == 3, codes
    for pod, code in codes.items():
        assert code in ({0} if "-rollout-" in pod else {0, 83}), codes
    cluster.kubectl.ok("delete", "rj", name, "-n", NS, "--wait=true", "--timeout=120s")
