"""Adapter refits between real sessions, without vLLM: a refit for another base model is
refused before anything is loaded, naming both digests; one for the served base is
loaded as ``<name>-v<refit>``.

Real: a policy ``PolicySession`` and a rollout ``RolloutSession`` (inside a
``StagedReceiver``, on its own thread) in one process, NIXL (UCX) between them, the
file-backed rendezvous (the test opens the barrier, as the operator would), the integrity
hashes.  In place of vLLM's loader: functions that record what they were asked to load
(the engines tier loads into vLLM itself, tests/engines/test_vllm_lora.py).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from refit_worker.contract.adapters import AdapterHeader, AdapterKnobs
from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig
from refit_worker.contract.roles import Role
from refit_worker.contract.shards import Layout
from refit_worker.integrations.staged import StagedReceiver
from refit_worker.integrations.vllm import AdapterLanding, AdapterRefused
from refit_worker.policy.policy_session import PolicySession
from refit_worker.rendezvous import FileStore
from refit_worker.rollout.rollout_session import RolloutSession

SERVED = "0123456789abcdef" * 2
OTHER = "fedcba9876543210" * 2
Q = "base_model.model.model.layers.0.self_attn.q_proj"


def _config(store: Path, role: Role) -> WorkerConfig:
    return WorkerConfig(
        job="lora",
        role=role,
        rank=0,
        policy_world_size=1,
        rollout_world_size=1,
        pod_uid=str(uuid.uuid4()),
        pod_name=f"lora-{role}-0",
        transfer=TransferConfig(
            bucket_size=64 << 10, timeout_seconds=20, refits=2, adapter=AdapterKnobs()
        ),
        rendezvous=RendezvousConfig(store="file", location=str(store)),
        termination_message_path=str(store.parent / f"{role}.termination"),
    )


def _header(digest: str) -> AdapterHeader:
    return AdapterHeader(
        name="lora", rank=4, alpha=8.0, target_modules=("q_proj",), base="b", base_digest=digest
    )


def _run_pair(tmp_path: Path, digests: list[str]) -> dict[str, Any]:
    """The policy sends refit k with base digest ``digests[k]``; the rollout lands each."""
    store_dir = tmp_path / "rdzv"
    store = FileStore(store_dir, Layout(1, 1, 1))
    loaded: list[tuple[str, int]] = []
    landing = AdapterLanding(
        StagedReceiver(RolloutSession(_config(store_dir, "rollout"))),
        adapter="lora",
        keep=1,
        base="served-base",
        base_digest=SERVED,
        load=lambda version, lora_id, directory: loaded.append((version, lora_id)),
        unload=lambda lora_id: None,
    )
    policy = PolicySession(_config(store_dir, "policy"))
    sent: dict[str, Any] = {}

    def send() -> None:
        try:
            policy.connect()
            for refit, digest in enumerate(digests):
                state = {f"{Q}.lora_A.weight": torch.full((4, 64), float(refit + 1))}
                state[f"{Q}.lora_B.weight"] = torch.ones(128, 4)
                stats = asyncio.run(
                    policy.send(state.items(), refit_id=refit, adapter=_header(digest))
                )
                sent[f"refit{refit}"] = stats.delivered
        except Exception as exc:  # reported to the test
            sent["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=send, daemon=True)
    outcome: dict[str, Any] = {"loaded": loaded, "sent": sent, "landed": [], "refused": []}
    try:
        landing.begin(0)
        thread.start()
        store.open_barrier(0, timeout=60)
        for refit in range(len(digests)):
            if refit:
                landing.begin(refit)
            try:
                outcome["landed"].append(landing.land(60).version)
                landing.commit()
            except AdapterRefused as exc:
                outcome["refused"].append(str(exc))
        thread.join(60)
        outcome["default"] = landing.versions.default
    finally:
        landing.receiver.close()
        policy.close()
    return outcome


def test_an_adapter_for_another_base_is_refused_before_it_loads(tmp_path: Path) -> None:
    outcome = _run_pair(tmp_path, [SERVED, OTHER])
    assert outcome["landed"] == ["lora-v0"], outcome
    assert outcome["loaded"] == [("lora-v0", 1)], "the refused refit reached the loader"
    (refused,) = outcome["refused"]
    assert SERVED in refused and OTHER in refused and "refit 1" in refused
    assert "error" not in outcome["sent"], outcome["sent"]
    assert outcome["default"] == "lora-v0"  # the version before it still answers


def test_the_served_base_loads_a_version_per_refit(tmp_path: Path) -> None:
    outcome = _run_pair(tmp_path, [SERVED, SERVED])
    assert outcome["landed"] == ["lora-v0", "lora-v1"], outcome
    assert outcome["loaded"] == [("lora-v0", 1), ("lora-v1", 2)]
    assert outcome["refused"] == [] and outcome["default"] == "lora-v1"


def test_the_adapter_bench_runs_and_reports_both_jobs() -> None:
    """``bench/adapter_refit.py --quick`` runs both jobs and reports their bytes (no timing
    is asserted: timings belong to the bench)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [
            sys.executable,
            str(root / "bench" / "adapter_refit.py"),
            "--quick",
            "--runs",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=root,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # rank 16 on 7 projections of 2 layers (hidden 256, intermediate 512), bf16, + header.
    lora = 2 * 16 * 2 * (4 * (256 + 256) + 3 * (256 + 512))
    assert lora <= result["adapter_bytes"] < lora + 1024, result
    assert result["x_bytes"] == result["whole_bytes"] / result["adapter_bytes"] > 1
    assert result["whole_s"] > 0 and result["adapter_s"] > 0 and "load" in result


def test_fsdp2_ranks_send_their_adapter_shards_without_a_gather(tmp_path: Path) -> None:
    """Two FSDP2 policy ranks (real gloo group, ``fully_shard``, AdamW) send a sharded
    adapter: each writes its own shards (only the plan's small collectives in the send),
    and the adapter the rollout writes for vLLM is the full one, bit for bit."""
    import contextlib
    import json
    import queue
    import time

    from safetensors.torch import load_file
    from tests.support import adapter_procs
    from tests.support.engine_procs import digest
    from tests.support.sharded_procs import CTX

    # The one refit plan's small collectives (tests/e2e/test_sharded_send.py): no gather.
    plan = ["torch.distributed.all_gather", *["torch.distributed.broadcast"] * 2]

    store_dir, pg = tmp_path / "rdzv", tmp_path / "pg"
    written: list[dict[str, str]] = []

    def load(version: str, lora_id: int, directory: Path) -> None:
        tensors = load_file(str(directory / "adapter_model.safetensors"))
        written.append({n: digest(t) for n, t in tensors.items()})

    landing = AdapterLanding(
        StagedReceiver(RolloutSession(adapter_procs.config(str(store_dir), "rollout", 0, 2))),
        adapter="fsdp",
        keep=1,
        base="tiny",
        base_digest=adapter_procs.HEADER["base_digest"],  # type: ignore[arg-type]
        load=load,
        unload=lambda lora_id: None,
    )
    out_q = CTX.Queue()
    procs = [
        CTX.Process(target=adapter_procs.policy_main, args=(str(store_dir), str(pg), r, out_q))
        for r in range(2)
    ]
    reports: dict[int, dict[str, Any]] = {}
    try:
        landing.begin(0)
        for proc in procs:
            proc.start()
        FileStore(store_dir, Layout(2, 1, 1)).open_barrier(0, timeout=120)
        for refit in range(2):
            if refit:
                landing.begin(refit)
            landing.land(120)
            landing.commit()
        deadline = time.monotonic() + 120
        while len(reports) < 2 and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                report = json.loads(out_q.get(timeout=0.5))
                reports[report["rank"]] = report
    finally:
        landing.receiver.close()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    assert set(reports) == {0, 1}, reports
    for report in reports.values():
        assert "error" not in report and report["dtensors"], report
        for calls in report["collectives"]:
            assert sorted(calls) == plan, calls
    want = reports[0]["refits"]
    assert reports[1]["refits"] == want and want[0] != want[1], "AdamW moved the adapter"
    assert written == want, "the adapter written for vLLM is not the trainer's"
    # Each rank wrote its own shards: together the adapter (2 x (q: 4x64 + 64x4, v: 4x64 +
    # 32x4) float32) and the header, once.
    mine = [reports[r]["bytes"][0] for r in (0, 1)]
    adapter = 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4) * 4
    assert min(mine) > 0 and adapter <= sum(mine) < adapter + 1024, mine


def test_refit_vllm_serve_registers_each_version_and_refuses_another_base(
    tmp_path: Path,
) -> None:
    """refit-vllm-serve's adapter side between real sessions over NIXL, vLLM's LoRA
    endpoints played by a loopback HTTP server: refit 0 is registered and made the
    default; refit 1, for another base, is refused before any call reaches the server;
    the session ends with refit 0 still the one registered."""
    from safetensors.torch import save_file
    from tests.support.lora_server import lora_server

    from refit_worker.contract.adapters import checkpoint_digest
    from refit_worker.integrations.vllm.serve_adapters import (
        serve_adapter_refits,
        served_adapter_landing,
    )
    from refit_worker.integrations.vllm.server import VllmServer

    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.zeros(4)}, str(model / "model.safetensors"))
    served = checkpoint_digest(model)
    store_dir = tmp_path / "rdzv"
    policy = PolicySession(_config(store_dir, "policy"))
    sent: dict[str, Any] = {}

    def send() -> None:
        try:
            policy.connect()
            for refit, digest in enumerate([served, OTHER]):
                state = {f"{Q}.lora_A.weight": torch.full((4, 64), float(refit + 1))}
                state[f"{Q}.lora_B.weight"] = torch.ones(128, 4)
                asyncio.run(policy.send(state.items(), refit_id=refit, adapter=_header(digest)))
        except Exception as exc:  # reported to the test
            sent["error"] = f"{type(exc).__name__}: {exc}"

    committed: list[dict[str, Any]] = []
    thread = threading.Thread(target=send, daemon=True)
    with lora_server() as (url, seen):
        landing = served_adapter_landing(
            VllmServer(url, call_timeout_s=10),
            _config(store_dir, "rollout"),
            str(model),
            stop=lambda: False,
        )
        thread.start()
        opener = threading.Thread(
            target=lambda: FileStore(store_dir, Layout(1, 1, 1)).open_barrier(0, timeout=60),
            daemon=True,
        )
        opener.start()
        try:
            with pytest.raises(AdapterRefused) as caught:
                serve_adapter_refits(landing, on_committed=committed.append)
        finally:
            policy.close()
        thread.join(60)
        opener.join(60)
    assert [c["default"] for c in committed] == ["lora-v0"] and committed[0]["loaded"] == [
        "lora-v0"
    ]
    assert [path for path, _ in seen] == ["/v1/load_lora_adapter"], seen
    assert seen[0][1]["lora_name"] == "lora-v0"
    refused = str(caught.value)
    assert served in refused and OTHER in refused and "refit 1" in refused
    assert "error" not in sent, sent
