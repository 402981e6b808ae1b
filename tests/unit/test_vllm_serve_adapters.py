"""refit-vllm-serve for adapter jobs: the capacity check on vllm serve's options, the
dynamic LoRA calls over real HTTP (a loopback server in place of vLLM: what reached it,
and how a refusal reads), and the refusal before any server starts (no vLLM here)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.support.lora_server import Seen, lora_server

from refit_worker.contract.adapters import AdapterKnobs
from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig
from refit_worker.contract.exits import EXIT_BAD_CONFIG
from refit_worker.integrations.vllm.serve import main
from refit_worker.integrations.vllm.serve_adapters import ServerLoras, serve_lora_problem
from refit_worker.integrations.vllm.server import VllmServer


@pytest.mark.parametrize(
    ("options", "keep", "says"),
    [
        (["--dtype", "float32"], 1, "--enable-lora"),
        (["--enable-lora"], 1, "holds 1"),  # vLLM's default max_loras
        (["--enable-lora", "--max-loras", "2"], 2, "needs vLLM to hold 3"),
        (["--enable-lora", "--max-loras=many"], 1, "'many': not a number"),
        (["--enable-lora", "--max-loras", "2"], 1, None),
        (["--enable-lora", "--max-loras", "1", "--max-cpu-loras=3"], 2, None),
    ],
)
def test_vllm_serve_options_must_hold_the_kept_versions_and_the_landing_one(
    options: list[str], keep: int, says: str | None
) -> None:
    problem = serve_lora_problem(options, keep)
    assert problem is None if says is None else (problem is not None and says in problem)


@pytest.fixture
def fake_vllm() -> Iterator[tuple[str, Seen]]:
    with lora_server() as found:
        yield found


def test_versions_are_registered_and_unregistered_by_name(
    fake_vllm: tuple[str, Seen], tmp_path: Path
) -> None:
    url, seen = fake_vllm
    loras = ServerLoras(VllmServer(url, call_timeout_s=5), "math")
    loras.load("math-v3", 4, tmp_path)
    loras.unload(4)  # LoRA id 4 is refit 3
    assert seen == [
        ("/v1/load_lora_adapter", {"lora_name": "math-v3", "lora_path": str(tmp_path)}),
        ("/v1/unload_lora_adapter", {"lora_name": "math-v3"}),
    ]
    with pytest.raises(RuntimeError, match=r"unload_lora_adapter answered 404: .*'math-v0'"):
        loras.unload(1)


def test_an_adapter_job_with_a_server_that_cannot_hold_it_starts_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = WorkerConfig(
        job="lora",
        role="rollout",
        rank=0,
        policy_world_size=1,
        rollout_world_size=1,
        pod_uid=str(uuid.uuid4()),
        pod_name="lora-rollout-0",
        transfer=TransferConfig(adapter=AdapterKnobs(keep=1)),
        rendezvous=RendezvousConfig(store="file", location=str(tmp_path / "rdzv")),
        termination_message_path=str(tmp_path / "termination"),
    )
    for name, value in config.to_env().items():
        monkeypatch.setenv(name, value)
    # No --enable-lora: refused before vllm serve is started (no such model exists here).
    assert main(["--", str(tmp_path / "no-model"), "--dtype", "float32"]) == EXIT_BAD_CONFIG
    assert "--enable-lora" in (tmp_path / "termination").read_text()
