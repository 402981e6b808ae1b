"""The RL example on the real control plane: FSDP2 trainers refit a vLLM rollout.

``kubectl apply`` of ``examples/rl-vllm/job.yaml`` with the env its pods need on these
process nodes (the cached vLLM environment's Python, the example's directory, this
checkout's worker on PYTHONPATH: what an image from docker/Dockerfile.vllm has built in);
kube-scheduler places the gang, the pods rendezvous over the job's ConfigMaps with their
own ServiceAccount tokens, two policy ranks train with FSDP2 on gloo, the rollout serves
with vLLM's CPU build and checks vLLM's greedy tokens against the trainer's HF ``generate``
after every refit before committing it (``verification: tokens``).

The same trainers with a ``vllm serve`` rollout (``examples/rl-vllm-serve/job.yaml``): the
rollout pod runs vLLM's OpenAI server through ``refit-vllm-serve``, and the example's
client sends the shared-prefix prompts to it all along.  The test then reads what the
pods wrote: every response's tokens and logprobs against HF on the weights of the version
the response names (the trainer's reference for each refit; HF on the initial
checkpoint, computed here, for ``default``), every refit answering at least one request,
the last label's digest against the job's versions ledger, and how long a request waited
when it met a landing.

Real: everything but the kubelet (process nodes) and the pod network (loopback).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from tests.cluster import records
from tests.cluster.controlplane import free_port
from tests.cluster.support import EXAMPLES, Cluster, Install, run_to_completion
from tests.engines.environment import example_manifest
from tests.engines.environment import install as install_engine_env

NS = "rl"
#: As the engines tier compares vLLM's logprobs with HF's (float32, CPU kernels).
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def venv() -> Path:
    """The vLLM environment (cached after the engines tier, or CI's install step)."""
    return install_engine_env()


@pytest.mark.timeout(1500)
def test_rl_vllm_example_refits_every_step_with_tokens_checked(
    cluster: Cluster, install: Install, venv: Path, tmp_path: Path
) -> None:
    manifest = tmp_path / "rl-vllm.yaml"
    doc = example_manifest("rl-vllm", venv, manifest)
    name = doc["metadata"]["name"]
    status = run_to_completion(cluster, NS, manifest, name)
    assert status["phase"] == "Succeeded", status
    assert status["refitsCompleted"] == doc["spec"]["transfer"]["refits"]
    assert status["verification"] == "tokens", status
    assert (status["restarts"], status["preemptions"]) == (0, 0)
    codes = cluster.gang_exit_codes(NS, name, 0)
    assert len(codes) == 3, codes
    for pod, code in codes.items():
        assert code in ({0} if "-rollout-" in pod else {0, 83}), codes
    cluster.kubectl.ok("delete", "rj", name, "-n", NS, "--wait=true", "--timeout=120s")


def _json_lines(text: str, key: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{") and f'"{key}"' in line[:16]:
            out.append(json.loads(line)[key])
    return out


def _initial_reference() -> tuple[list[list[int]], list[list[float]]]:
    """HF on the checkpoint the rollout starts from (seed 0), computed here."""
    import sys

    sys.path.insert(0, str(EXAMPLES / "rl-vllm"))
    import tiny_llama

    model = tiny_llama.build_model(seed=0)
    tokens = tiny_llama.hf_greedy(model)
    return tokens, tiny_llama.hf_logprobs(model, tokens)


@pytest.mark.timeout(1500)
def test_a_vllm_serve_rollout_answers_each_request_with_the_refit_it_names(
    cluster: Cluster, install: Install, venv: Path, tmp_path: Path
) -> None:
    manifest = tmp_path / "rl-vllm-serve.yaml"
    doc = example_manifest("rl-vllm-serve", venv, manifest, SERVE_PORT=str(free_port()))
    name, refits = doc["metadata"]["name"], doc["spec"]["transfer"]["refits"]
    status = run_to_completion(cluster, NS, manifest, name)
    assert status["phase"] == "Succeeded", status
    assert status["refitsCompleted"] == refits
    # The backend read every served layer back, and the pause cleared the caches.
    assert status["verification"] == "served-params", status
    codes = cluster.gang_exit_codes(NS, name, 0)
    assert len(codes) == 3, codes
    for pod, code in codes.items():
        assert code in ({0} if "-rollout-" in pod else {0, 83}), codes

    pods = cluster.gang(NS, name, 0)
    logs = {pod: cluster.pod_log(pod, uid) for pod, uid in pods}
    rollout = next(text for pod, text in logs.items() if "-rollout-" in pod)
    trainer = next(text for pod, text in logs.items() if pod.endswith("-policy-0-e0"))
    responses = _json_lines(rollout, "response")
    landings = _json_lines(rollout, "landed")
    expected = {row["refit"]: row for row in _json_lines(trainer, "expected")}
    assert sorted(expected) == list(range(refits)), expected.keys()
    assert [row["refit_id"] for row in landings] == list(range(refits)), landings

    # Every label names its refit; the last one's digest is the ledger's.
    labels = {row["weight_version"]: row["refit_id"] for row in landings}
    assert all(label.startswith(f"refit-{k}@xxh3_64:") for label, k in labels.items())
    ledger = status["versions"]
    assert [(r["refit"], r["replicas"]) for r in ledger] == [(refits - 1, [0])], ledger
    assert landings[-1]["weight_version"] == f"refit-{refits - 1}@{ledger[0]['digest']}"

    initial_tokens, initial_logprobs = _initial_reference()
    answered: dict[str, int] = {}
    for response in responses:
        spans = response["versions"]
        # One version per response: the pause lets requests in flight finish first.
        assert len(spans) == 1 and spans[0]["start"] == 0, response
        label = spans[0]["version"]
        prompt = response["prompt"]
        if label == "default":
            want_tokens, want_logprobs = initial_tokens[prompt], initial_logprobs[prompt]
        else:
            assert label in labels, f"a response names {label!r}, no landing set it"
            row = expected[labels[label]]
            want_tokens, want_logprobs = row["tokens"][prompt], row["logprobs"][prompt]
        assert response["tokens"] == want_tokens, (label, response)
        gap = max(abs(a - b) for a, b in zip(response["logprobs"], want_logprobs, strict=True))
        assert gap <= LOGPROB_ATOL, (label, gap, response)
        answered[label] = answered.get(label, 0) + 1
    assert set(labels) <= set(answered), ("a refit answered no request", answered)

    # How long a request waited when it met a landing (sent before the server resumed,
    # answered after it paused), against every other request.
    def met(response: dict[str, Any], landing: dict[str, Any]) -> bool:
        return (
            response["sent_at"] < landing["resumed_at"]
            and response["answered_at"] > landing["paused_at"]
        )

    during, outside = [], []
    for response in responses:
        waited = response["answered_at"] - response["sent_at"]
        (during if any(met(response, x) for x in landings) else outside).append(waited)
    held = [x["paused_s"] for x in landings]
    records.record(
        "vllm serve rollout",
        f"{len(responses)} responses over {refits} refits, each equal to HF for the version "
        f"it names ({sorted(answered.items())}); requests held {statistics.median(held):.3f} s "
        f"per landing (median; max {max(held):.3f} s; drain of in-flight requests median "
        f"{statistics.median(x['drain_s'] for x in landings):.3f} s); a request that met a "
        f"landing took median {statistics.median(during) if during else 0:.3f} s "
        f"(max {max(during, default=0):.3f} s, {len(during)} requests) vs "
        f"{statistics.median(outside):.3f} s otherwise",
    )
    cluster.kubectl.ok("delete", "rj", name, "-n", NS, "--wait=true", "--timeout=120s")
