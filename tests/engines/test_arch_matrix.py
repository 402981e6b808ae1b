"""What vLLM serves is what was sent, across architectures (issue #28).

For each case one vLLM engine (CPU, in-process) is refitted by a two-rank FSDP2 trainer
(``arch_trainer.py``: real AdamW steps on real tokens, DTensors sent shard by shard) and
every refit is checked on the rollout (``arch_rollout.py``) against the ground truth the
trainer computed on exactly those weights: HF ``generate``'s greedy tokens and each
token's logprob.  kube-refit's own read-back of every served layer runs inside each
landing.  The cases:

- ``llama`` (untied) through the worker extension, with a fault planted in the fourth
  landing (a test-only extension leaves out one tensor after every pre-landing check
  passed): the refit must be rejected, naming the tensor, the rank exit non-zero, and the
  job's progress not count it;
- ``qwen2-tied`` (tied embeddings, q/k/v bias, GQA 8/2, uneven vocabulary) through vLLM's
  weight-transfer registry (backend ``kube-refit``): the status must say
  ``served-params``, the level the backend reaches on its own;
- ``qwen2-moe`` (4 experts, top-2, a shared expert) through the extension; the trainer
  holds the experts fused as transformers 5 does and sends them so in refits 0, 2 and 4,
  and by the checkpoint's per-expert names in refits 1 and 3 (each change of names lands
  in newly allocated memory, over memory an earlier landing used); the rollout claims
  only the landing's own read-back, which reaches every layer (the fused experts through
  their kernel), so the status must say ``served-params``; four refits must commit, and a
  fault planted in the fifth landing (one expert's ``down_proj`` left out) must be
  rejected naming that expert and no other;
- ``qwen2-tied-mp``: the tied model through the extension with vLLM's engine core in its
  own process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``): the landing, the redo and the
  read-back run there, every ``refit_*`` call crosses vLLM's RPC as plain data;
- ``qwen2-moe-backend-mp``: the MoE through the registry backend with the engine core in
  its own process, the names changing between refits: ``served-params`` from the
  backend's landing alone;
- ``qwen2-moe-delta`` and ``llama-delta``: delta refits (``delta: on``) from a trainer
  that trains a few tensors and freezes the rest, so each refit after the first comes as
  its changes alone and lands only the whole vLLM modules they feed: a part of the fused
  q/k/v (a third of ``qkv_proj``), one layer's fused experts (the other layer's experts,
  untouched, keep their prepacked state), a plain layer.  The counts of tensors reloaded
  are asserted, and the tokens and the read-back of every layer prove the untouched
  modules too.  In ``llama-delta`` the third landing's subset is broken on purpose (a
  test-only extension leaves out one of its tensors): the read-back must catch it, the
  refit be landed again whole and commit, and every later refit land whole.

- ``qwen2-moe-tied-tp2``: a Qwen2-MoE with tied embeddings at ``tensor_parallel_size=2``
  (vLLM's ``mp`` executor): each worker is a rollout rank that declares its part of every
  tensor from vLLM's own layers and receives only that (the bytes per worker are
  asserted: half the split tensors plus the whole ones, the padded vocabulary split
  32 + 28 rows); each reads its own parts back, the experts through their kernel, and
  both ranks' status must say ``served-params``.

Real: vLLM, FSDP2 on gloo, NIXL (UCX), the file-backed rendezvous (the test opens the
barrier, as the operator would).  Emulated: only the planted fault.
"""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest
from tests.engines import archs
from tests.engines.environment import HERE, engine_env
from tests.engines.fault_extension import FAULTY_EXTENSION
from tests.engines.procs import JsonProc

from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig
from refit_worker.contract.exits import EXIT_NOT_RETRYABLE
from refit_worker.integrations.vllm import WORKER_EXTENSION
from refit_worker.rendezvous import FileStore, Layout

pytestmark = pytest.mark.timeout(1200)
START_TIMEOUT_S = 600
CASES: dict[str, dict[str, Any]] = {
    "llama": {
        "arch": "llama",
        "path": "extension",
        "refits": 4,
        "fault_at": 3,
        "skip": "model.layers.1.mlp.down_proj.weight",
        "named": ["model.layers.1.mlp.down_proj"],
    },
    "qwen2-tied": {"arch": "qwen2-tied", "path": "backend", "refits": 3},
    # Claims only what the landing's read-back reached (the tokens are checked all the
    # same): with the experts read back, that is every layer.  The names alternate
    # (fused, per expert, fused, per expert): a rollout whose landing memory moves under
    # a sender that loaded the old memory's metadata (the 4th refit's NIXL_ERR_NOT_FOUND
    # of docs/engines.md, fixed).  The fault: one expert's down_proj left out of the 5th
    # landing (sent fused).
    "qwen2-moe": {
        "arch": "qwen2-moe",
        "path": "extension",
        "refits": 5,
        "per_expert_at": [1, 3],
        "claim": None,
        "fault_at": 4,
        "skip": "model.layers.1.mlp.experts.2.down_proj.weight",
        "named": ["model.layers.1.mlp.experts.2.{gate_proj,up_proj,down_proj}.weight"],
        "not_named": [f"model.layers.1.mlp.experts.{e}." for e in (0, 1, 3)],
        "experts": ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"],
    },
    # vLLM's engine core in its own process: every refit_* call crosses its RPC.
    "qwen2-tied-mp": {"arch": "qwen2-tied", "path": "extension", "refits": 3, "mp": True},
    # The MoE through the registry backend, engine core in its own process: the backend's
    # own landing must redo the experts' prepack and read them back (served-params), with
    # the names changing between refits (fused, per expert, fused).
    "qwen2-moe-backend-mp": {
        "arch": "qwen2-moe",
        "path": "backend",
        "refits": 3,
        "per_expert_at": [1],
        "mp": True,
    },
    # Only q_proj of layer 0 (widened to q/k/v and their biases: 6) and layer 1's experts'
    # down_proj (widened to the fused experts, 4 experts x 3: 12) change: 18 of 55 land.
    "qwen2-moe-delta": {
        "arch": "qwen2-moe",
        "path": "extension",
        "refits": 4,
        "claim": None,
        "delta": "on",
        "train_only": [
            "model.layers.0.self_attn.q_proj",
            "model.layers.1.mlp.experts.down_proj",
        ],
        "reloaded": [[55, 55], [18, 55], [18, 55], [18, 55]],
    },
    # Mixtral: transformers 5 holds its experts fused under names (`mlp.experts.gate_up_proj`,
    # `mlp.gate`) that its checkpoint spells `block_sparse_moe.experts.<e>.w1/w2/w3`,
    # `block_sparse_moe.gate`: mapped with transformers' own conversion mapping.
    "mixtral": {"arch": "mixtral", "path": "extension", "refits": 3, "claim": None},
    "mixtral-backend": {"arch": "mixtral", "path": "backend", "refits": 3},
    # A trainer that names one tensor as the served model does not: refused before any
    # landing, naming both names, and the rank exits not-retryable (the job fails at once,
    # no replacement: tests/unit/test_failure_policy.py).
    "llama-misnamed": {
        "arch": "llama",
        "path": "extension",
        "refits": 2,
        "rename": {"model.layers.1.mlp.down_proj.weight": "model.layers.1.mlp.down.weight"},
    },
    # Layer 0's down_proj (1) and layer 1's k_proj (widened to q/k/v: 3) of 21.  The third
    # landing leaves layer 1's q_proj out: landed again whole, and so is the fourth.
    "llama-delta": {
        "arch": "llama",
        "path": "extension",
        "refits": 4,
        "delta": "on",
        "train_only": ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.k_proj"],
        "break_landing": 2,
        "skip": "model.layers.1.self_attn.q_proj.weight",
        "reloaded": [[21, 21], [4, 21], [21, 21], [21, 21]],
    },
    # Tensor parallelism 2 (vLLM's "mp" executor, one worker process per rank): each
    # worker is a rollout rank that declares its part of every tensor from vLLM's own
    # layers (q/k/v with GQA and biases, the shared expert's gate/up, each expert's
    # intermediate rows, the tied vocabulary of 60 rows padded to 64 split 32 + 28) and
    # receives only that; its own read-back probes its parts, the experts through their
    # kernel (served-params).  The experts go by the checkpoint's per-expert names: the
    # parts are declared by those (transformers 5's fused names would come whole and be
    # refused by the layout check).
    "qwen2-moe-tied-tp2": {
        "arch": "qwen2-moe-tied",
        "path": "extension",
        "refits": 3,
        "per_expert_at": [0, 1, 2],
        "claim": None,
        "tp": 2,
        "experts": ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"],
        # 4 vocabulary rows of 128 floats between the two workers' parts.
        "rows_apart_bytes": 4 * 128 * 4,
    },
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(
    store: Path,
    role: str,
    rank: int,
    refits: int,
    port: int,
    delta: str | None = None,
    rollouts: int = 1,
) -> dict[str, str]:
    return WorkerConfig(
        job="matrix",
        role=role,  # type: ignore[arg-type]
        rank=rank,
        policy_world_size=2,
        rollout_world_size=rollouts,
        epoch=0,
        pod_uid=str(uuid.uuid4()),
        pod_name=f"matrix-{role}-{rank}",
        master_port=port,
        transfer=TransferConfig(
            bucket_size=256 << 10,
            timeout_seconds=120,
            refits=refits,
            delta=delta,  # type: ignore[arg-type]
        ),
        rendezvous=RendezvousConfig(store="file", location=str(store)),
        termination_message_path=str(store.parent / f"{role}-{rank}.termination"),
    ).to_env()


def _run(arch: str, case: dict[str, Any], python: Path, tmp: Path) -> dict[str, Any]:
    store_dir, refits, port = tmp / "rdzv", case["refits"], _free_port()
    tp = case.get("tp", 1)  # each tensor-parallel worker is a rollout rank
    store = FileStore(store_dir, Layout(2, tp, 1))
    delta = case.get("delta")
    # A fault in the landing: one that fails the refit, or one in a subset landing that
    # the landing must heal by landing the refit whole.
    fault = case.get("fault_at", case.get("break_landing"))
    rollout = JsonProc(
        [str(python), str(HERE / "arch_rollout.py")],
        engine_env(
            ENGINE_ROLLOUT=json.dumps(
                {
                    "arch": arch,
                    "model_dir": str(tmp / "model"),
                    "path": case["path"],
                    "refits": refits,
                    "env": _env(store_dir, "rollout", 0, refits, port, delta, tp),
                    "tp": tp,
                    "extension": FAULTY_EXTENSION if fault is not None else WORKER_EXTENSION,
                    "claim": case.get("claim", "tokens"),
                }
            ),
            ENGINE_SKIP_AT=str(fault if fault is not None else -1),
            ENGINE_SKIP_TENSOR=case.get("skip", ""),
            VLLM_ENABLE_V1_MULTIPROCESSING="1" if case.get("mp") else "0",
        ),
        tmp / "rollout.log",
    )
    trainer_opts = json.dumps(
        {
            "arch": arch,
            "model_dir": str(tmp / "model"),
            "per_expert_at": case.get("per_expert_at", []),
            "train_only": case.get("train_only"),
            "rename": case.get("rename"),
        }
    )
    policies: list[JsonProc] = []
    try:
        started = rollout.wait_for(
            "started", lambda m: m.get("step") in ("started", "error"), START_TIMEOUT_S
        )
        assert started["step"] == "started", started
        policies = [
            JsonProc(
                [str(python), str(HERE / "arch_trainer.py")],
                engine_env(
                    **_env(store_dir, "policy", rank, refits, port, delta, tp),
                    ENGINE_TRAINER=trainer_opts,
                ),
                tmp / f"policy-{rank}.log",
            )
            for rank in (0, 1)
        ]
        store.open_barrier(0, timeout=300)
        end = rollout.wait_for(
            "the end", lambda m: m.get("step") in ("done", "error", "rejected"), 900
        )
        return {
            "started": started,
            "end": end,
            "refits": [m for m in rollout.seen if m.get("step") == "refit"],
            "rejected": [m for m in rollout.seen if m.get("step") == "rejected"],
            "exit": rollout.stop(60),
            "trained": [
                p.wait_for("refit", lambda m, k=k: m.get("refit") == k, 300)
                for p in policies[:1]
                # A refused trainer never gets past its first refit.
                for k in range(0 if case.get("rename") else refits)
            ],
            "losses": [[m["fixed_loss"] for m in p.seen if "loss" in m] for p in policies],
            "progress": store.snapshot(0).progress[("rollout", 0)],
            "workers": [store.snapshot(0).progress[("rollout", r)] for r in range(tp)],
        }
    finally:
        for proc in [rollout, *policies]:
            if proc.proc.poll() is None:
                proc.proc.kill()
            proc.stop(10)


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_serves_what_the_trainer_sent(name: str, engine_python: Path, tmp_path: Path) -> None:
    case = CASES[name]
    arch = case["arch"]
    found = _run(arch, case, engine_python, tmp_path)
    if "rename" in case:
        _assert_refused_at_once(case, found)
        return
    refits, truth = found["refits"], found["trained"]
    good = case.get("fault_at", case["refits"])
    assert [r["refit"] for r in refits] == list(range(good)), found
    labels = []
    for got, want in zip(refits, truth, strict=False):
        if case["path"] == "extension":  # the caller's check, between landing and commit
            assert got["tokens"] == want["tokens"], (arch, got, want)
            assert got["logprob_gap"] < 1e-3, (arch, got, want)
            assert got["versions"] == [f"refit-{got['refit']}@landing"], got
        # What a client gets once the refit is committed: the trainer's tokens for exactly
        # that refit's weights (the prompts share a prefix whose KV blocks vLLM cached from
        # older weights), tagged with that refit's version.
        after = got["after"]
        assert after["tokens"] == want["tokens"], (arch, got, want)
        assert archs.logprob_gap(after["logprobs"], want["logprobs"]) < 1e-3, (arch, got, want)
        label = got["figures"]["weight_version"] if "figures" in got else got["version"]
        assert label.startswith(f"refit-{got['refit']}@xxh3_64:"), got
        assert after["versions"] == [label], got
        labels.append(label)
    # Not vacuous: the refits changed what vLLM generates.
    assert any(r["after"]["tokens"] != found["started"]["tokens"] for r in refits)
    # The trainer really trained: rank 0's loss on one fixed batch fell.
    losses = found["losses"][0]
    assert len(losses) == case["refits"] and losses[-1] < losses[0], losses
    progress = found["progress"]
    assert progress.refits_completed == good
    # The rank's report names the version its last response was tagged with.
    assert progress.serving is not None and progress.serving.label == labels[-1], progress
    if case["path"] == "backend" or case.get("claim", "tokens") is None:
        assert progress.verification == "served-params", progress
    else:
        assert progress.verification == "tokens", progress
    for got in refits if case["path"] == "extension" else []:
        # The read-back reached every layer, the fused experts' kernels included.
        assert got["unprobed"] == [], got
        for layer in case.get("experts", []):
            assert f"{layer}.routed_experts" in got["probed"], got
    if "reloaded" in case:  # each delta landed only its modules (or whole, after a fault)
        assert [r["reloaded"] for r in refits] == case["reloaded"], refits
        assert [r["figures"]["reloaded"] for r in refits] == case["reloaded"], refits
    if "tp" in case:
        _assert_parts(case, found)
    if "fault_at" in case:
        (rejected,) = found["rejected"]
        assert rejected["refit"] == case["fault_at"]
        for name in case["named"]:
            assert name in rejected["error"] and name in progress.message, (rejected, progress)
        for name in case.get("not_named", []):
            assert name not in rejected["error"], rejected
        assert found["exit"] != 0
        assert progress.state == "failed", progress
    else:
        assert found["end"]["step"] == "done" and found["exit"] == 0, found
        assert progress.state == "done", progress


def _assert_parts(case: dict[str, Any], found: dict[str, Any]) -> None:
    """Each worker committed every refit at served-params and received about its share of
    the split tensors plus the whole ones (norms, routers), not the whole model."""
    tp = case["tp"]
    model, whole = found["started"]["model_bytes"], found["started"]["whole_bytes"]
    for progress in found["workers"]:
        assert progress.state == "done", progress
        assert progress.verification == "served-params", progress
    for got in found["refits"]:
        sizes = [w["bytes"] for w in got["figures"]["workers"]]
        assert len(sizes) == tp, got
        share = (model - whole) / tp + whole
        # Within 5%: the padded vocabulary splits 32 + 28 rows, and the refit's extras (the
        # reference tokens and logprobs) ride along to each worker.
        assert all(abs(size - share) < 0.05 * share for size in sizes), (sizes, model, whole)
        assert sum(sizes) < model * 0.55 * tp, (sizes, model)
        # The padded vocabulary splits unevenly: the first worker holds more rows.
        assert sizes[0] - sizes[1] == case["rows_apart_bytes"], sizes


def _assert_refused_at_once(case: dict[str, Any], found: dict[str, Any]) -> None:
    (rejected,) = found["rejected"]
    assert rejected["refit"] == 0 and not found["refits"], found
    for sent, served in case["rename"].items():
        assert f"missing {sent!r}" in rejected["error"], rejected
        assert f"unexpected {served!r}" in rejected["error"], rejected
    assert "nothing landed" in rejected["error"], rejected
    assert rejected["refused_after_s"] < 10, rejected
    assert found["exit"] == EXIT_NOT_RETRYABLE, found
    progress = found["progress"]
    assert progress.state == "failed" and progress.refits_completed == 0, progress
