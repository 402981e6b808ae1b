"""LoRA adapter refits into vLLM: a real PEFT LoRA trained with AdamW, each refit only the
adapter, served as a new version; tokens and logprobs equal HF + PEFT's every refit.

Real: vLLM's CPU build serving the tiny Llama with LoRA on (``lora_rollout.py``, one
engine), a trainer process with transformers + peft and torch's AdamW (``lora_policy.py``)
sending with ``RefitSession`` over NIXL (UCX), the file-backed rendezvous (the test opens
the barrier, as the operator would).  Nothing is emulated.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.engines.environment import HERE, engine_env
from tests.engines.procs import JsonProc

from refit_worker.contract.adapters import AdapterKnobs
from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig
from refit_worker.rendezvous import FileStore, Layout

REFITS = 3
ADAPTER = "lora"
pytestmark = pytest.mark.timeout(1200)
START_TIMEOUT_S = 600  # a cold `import vllm` on a loaded 2-core machine
STEP_TIMEOUT_S = 300


def _env(store: Path, role: str) -> dict[str, str]:
    config = WorkerConfig(
        job="engines-lora",
        role=role,  # type: ignore[arg-type]
        rank=0,
        policy_world_size=1,
        rollout_world_size=1,
        pod_uid=str(uuid.uuid4()),
        pod_name=f"engines-lora-{role}-0",
        transfer=TransferConfig(
            bucket_size=64 << 10,
            timeout_seconds=120,
            refits=REFITS,
            adapter=AdapterKnobs(name=ADAPTER, keep=1),
        ),
        rendezvous=RendezvousConfig(store="file", location=str(store)),
        termination_message_path=str(store.parent / f"{role}.termination"),
    )
    return config.to_env()


@pytest.fixture(scope="module")
def lora_run(engine_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("vllm-lora")
    store_dir = tmp / "rdzv"
    store = FileStore(store_dir, Layout(1, 1, 1))
    opts = {"model_dir": str(tmp / "model"), "adapter": ADAPTER, "steps": 3, "refits": REFITS}
    rollout = JsonProc(
        [str(engine_python), str(HERE / "lora_rollout.py")],
        engine_env(ENGINE_LORA=json.dumps({**opts, "env": _env(store_dir, "rollout")})),
        tmp / "rollout.log",
    )
    procs = [rollout]
    found: dict[str, Any] = {"refits": [], "sent": []}
    try:
        found["started"] = rollout.wait_for(
            "the engine's start", lambda m: m.get("step") in ("started", "error"), START_TIMEOUT_S
        )
        policy = JsonProc(
            [str(engine_python), str(HERE / "lora_policy.py")],
            engine_env(**_env(store_dir, "policy"), ENGINE_LORA=json.dumps(opts)),
            tmp / "policy.log",
        )
        procs.append(policy)
        store.open_barrier(0, timeout=STEP_TIMEOUT_S)
        for k in range(REFITS):
            line = rollout.wait_for(
                f"adapter refit {k}", lambda m: m.get("step") in ("refit", "error"), STEP_TIMEOUT_S
            )
            assert line["step"] == "refit", f"the rollout failed: {line}"
            found["refits"].append(line)
            found["sent"].append(policy.wait_for(f"refit {k} sent", lambda m: "sent" in m, 60))
        rollout.wait_for("the engine's shutdown", lambda m: m.get("step") == "done", 120)
        (tmp / "found.json").write_text(json.dumps(found, indent=1))  # for a failure's reader
        yield found
    finally:
        for proc in procs:
            if proc.proc.poll() is None:
                proc.proc.kill()
            proc.stop(10)


def test_every_adapter_refit_serves_hf_peft_tokens_and_logprobs(lora_run: dict) -> None:
    base = lora_run["started"]["base_tokens"]
    for k, line in enumerate(lora_run["refits"]):
        assert line["version"] == f"{ADAPTER}-v{k}" and line["served_by"] == line["version"]
        assert line["tokens"] == line["expected_tokens"], line
        assert line["logprob_gap"] <= 1e-3, line
        assert line["figures"] is not None, "not committed"
        # The default after the commit is this version, answering the same tokens.
        assert line["default_after"] == line["version"] and line["tokens_after"] == line["tokens"]
    # Training changed what the adapter answers: refit 0 already differs from the base,
    # and the refits differ from one another.
    tokens = [line["tokens"] for line in lora_run["refits"]]
    assert tokens[0] != base and len({json.dumps(t) for t in tokens}) > 1, tokens


def test_the_served_adapter_is_read_back_from_vllms_lora_layers(lora_run: dict) -> None:
    for line in lora_run["refits"]:
        # Every module the adapter trains: 2 layers x (q_proj, v_proj, down_proj).
        # (a difference would have refused the refit: LandingError, nothing committed)
        assert len(line["probed"]) == 6, line["probed"]


def test_only_adapter_bytes_travel(lora_run: dict) -> None:
    for sent in lora_run["sent"]:
        # rank 4: q (4x128 + 128x4), v (4x128 + 64x4), down (4x256 + 128x4) per layer, float32.
        adapter = 2 * 4 * (4 * 128 + 128 * 4 + 4 * 128 + 64 * 4 + 4 * 256 + 128 * 4)
        assert adapter <= sent["bytes"] < adapter + 4096, sent


def test_a_request_naming_an_unloaded_version_is_refused_naming_it(lora_run: dict) -> None:
    for k, line in enumerate(lora_run["refits"]):
        assert line["loaded"] == [f"{ADAPTER}-v{k}"]  # keep: 1
        for old, answer in line["older"].items():
            assert f"'{ADAPTER}-v{old}' is not loaded" in answer, answer
