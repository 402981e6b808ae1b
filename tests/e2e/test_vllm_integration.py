"""The engine-agnostic parts of the vLLM integration, in the project's own environment.

Which staged tensors are weights and which ride along, whether a refit's layout may
replace the served checkpoint's (real safetensors files), the reported split of a refit
into phases, the receiver's answers to calls out of order (a real session, its background
thread), and that the integration module loads in a Python without vLLM (a real
subprocess; it imports vLLM only inside a vLLM process).  The real engine is exercised in
tests/engines.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from refit_worker import RefitSession, RefitStats
from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig
from refit_worker.integrations.staged import (
    EXTRA_PREFIX,
    CommittedFigures,
    StagedReceiver,
    split_extras,
)
from refit_worker.integrations.vllm import checkpoint_layout, layout_problems


def test_extras_are_kept_out_of_the_weights() -> None:
    w, t = torch.zeros(2, 3), torch.tensor([[1, 2]])
    weights, extras = split_extras({"model.w": w, EXTRA_PREFIX + "expected_tokens": t})
    assert list(weights) == ["model.w"] and weights["model.w"] is w
    assert list(extras) == ["expected_tokens"] and extras["expected_tokens"] is t


@pytest.mark.parametrize(
    ("sent", "problem"),
    [
        ({"a": (2, 3), "b": (4,)}, None),
        ({"a": (2, 3)}, "missing 'b'"),
        ({"a": (2, 3), "b": (4,), "c": (1,)}, "unexpected 'c'"),
        ({"a": (3, 2), "b": (4,)}, "'a' has shape (3, 2), the served model (2, 3)"),
    ],
)
def test_a_refit_must_replace_every_served_tensor_with_its_shape(
    sent: dict[str, tuple[int, ...]], problem: str | None
) -> None:
    served = {"a": (2, 3), "b": (4,)}
    problems = layout_problems(served, {n: torch.zeros(s) for n, s in sent.items()})
    assert problems == ([] if problem is None else [problem])


def test_no_served_layout_means_nothing_to_check() -> None:
    assert layout_problems(None, {"anything": torch.zeros(1)}) == []


def test_the_served_layout_comes_from_the_checkpoints_headers(tmp_path: Path) -> None:
    save_file({"x.weight": torch.zeros(3, 4)}, str(tmp_path / "model-1.safetensors"))
    save_file(
        {"y.bias": torch.zeros(5, dtype=torch.bfloat16)}, str(tmp_path / "model-2.safetensors")
    )
    assert checkpoint_layout(tmp_path) == {"x.weight": (3, 4), "y.bias": (5,)}
    assert checkpoint_layout("meta-llama/Llama-3-8B") is None  # a hub id: not checked here
    assert checkpoint_layout(tmp_path / "empty-dir-missing") is None


def test_the_reported_message_names_each_phase() -> None:
    figures = CommittedFigures(RefitStats(3, 1000, 0.25), landing_s=0.5, verify_s=0.125)
    assert figures.message == (
        "refit 3 committed: transfer 0.2500 s, landing 0.5000 s, verification 0.1250 s"
    )


def test_calls_out_of_order_say_what_to_call_first(tmp_path: Path) -> None:
    config = WorkerConfig(
        job="unit",
        role="rollout",
        rank=0,
        policy_world_size=1,
        rollout_world_size=1,
        pod_uid=str(uuid.uuid4()),
        transfer=TransferConfig(timeout_seconds=5),
        rendezvous=RendezvousConfig(store="file", location=str(tmp_path)),
    )
    receiver = StagedReceiver(RefitSession(config))
    try:
        with pytest.raises(RuntimeError, match=r"call begin\(refit_id\) first"):
            receiver.staged()
        with pytest.raises(RuntimeError, match=r"call begin\(refit_id\) first"):
            receiver.commit(landing_s=0.0)
        receiver.reject("nothing in flight: a no-op")
        assert receiver.in_flight is None and not receiver.ready()
    finally:
        receiver.close()
        receiver.close()  # idempotent


def test_the_integration_loads_without_vllm() -> None:
    code = (
        "import sys, refit_worker.integrations.vllm as v; "
        "assert 'vllm' not in sys.modules, 'vLLM was imported'; print(v.WORKER_EXTENSION)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refit_worker.integrations.vllm.extension.RefitWorkerExtension"
