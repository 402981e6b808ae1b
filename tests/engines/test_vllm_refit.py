"""vLLM refitted over NIXL from a real policy process: tokens after a refit, and after a
preempted one.

Real: vLLM's CPU build serving a tiny Llama in-process (``engine_rollout.py``, one engine
for the whole session), policy processes (``engine_policy.py``) sending with
``RefitSession`` over NIXL (UCX), the file-backed rendezvous (the test opens each epoch's
barrier, as the operator would), a real SIGTERM via ``os.kill``.  The one test hook: the
policy stalls after the first bucket of the refit to preempt, so the signal reliably lands
mid-transfer.  HF ``generate`` on the sent weights (in the policy process) is the
reference every vLLM token is compared with.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.engines.environment import HERE, engine_env
from tests.engines.procs import JsonProc

from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig
from refit_worker.rendezvous import FileStore, Layout

REFITS = 2
# An engine start plus its refits, on a loaded 2-core machine (the default is 300 s).
pytestmark = pytest.mark.timeout(1500)
START_TIMEOUT_S = 600  # a cold `import vllm` on a loaded 2-core machine
STEP_TIMEOUT_S = 300


def _env(store: Path, role: str, epoch: int) -> dict[str, str]:
    config = WorkerConfig(
        job="engines",
        role=role,  # type: ignore[arg-type]
        rank=0,
        policy_world_size=1,
        rollout_world_size=1,
        epoch=epoch,
        first_refit=epoch,  # epoch 1 resumes after refit 0, the last one committed
        pod_uid=str(uuid.uuid4()),
        pod_name=f"engines-{role}-0",
        transfer=TransferConfig(bucket_size=64 << 10, timeout_seconds=120, refits=REFITS),
        rendezvous=RendezvousConfig(store="file", location=str(store)),
        termination_message_path=str(store.parent / f"{role}-{epoch}.termination"),
    )
    return config.to_env()


def _step(proc: JsonProc, name: str, timeout: float = STEP_TIMEOUT_S) -> dict[str, Any]:
    line = proc.wait_for(f"step {name!r}", lambda m: m.get("step") in (name, "error"), timeout)
    if line["step"] == "error":
        raise AssertionError(f"the engine failed: {line['error']}\n{line.get('trace', '')}")
    return line


@pytest.fixture(scope="session")
def scenario(engine_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("vllm-refit")
    store_dir = tmp / "rdzv"
    store = FileStore(store_dir, Layout(1, 1, 1))
    rollout_opts = {
        "model_dir": str(tmp / "model"),
        "dtype": "float32",
        "env": [_env(store_dir, "rollout", 0), _env(store_dir, "rollout", 1)],
    }
    rollout = JsonProc(
        [str(engine_python), str(HERE / "engine_rollout.py")],
        engine_env(ENGINE_ROLLOUT=json.dumps(rollout_opts)),
        tmp / "rollout.log",
    )
    policies: list[JsonProc] = []

    def policy(epoch: int, **opts: Any) -> JsonProc:
        proc = JsonProc(
            [str(engine_python), str(HERE / "engine_policy.py")],
            engine_env(**_env(store_dir, "policy", epoch), ENGINE_POLICY=json.dumps(opts)),
            tmp / f"policy-{epoch}.log",
        )
        policies.append(proc)
        return proc

    found: dict[str, Any] = {}
    try:
        found["started"] = _step(rollout, "started", START_TIMEOUT_S)
        first = policy(0, pause_at=1)
        store.open_barrier(0, timeout=STEP_TIMEOUT_S)
        found["landed"] = _step(rollout, "landed")
        found["progress0"] = store.snapshot(0).progress[("rollout", 0)]
        found["sent0"] = first.wait_for("refit 0 sent", lambda m: m.get("sent") == 0, 60)
        _step(rollout, "preempt-me")
        first.wait_for("the stall mid-refit 1", lambda m: "paused" in m, STEP_TIMEOUT_S)
        os.kill(rollout.pid, signal.SIGTERM)
        found["preempted"] = _step(rollout, "preempted")
        found["progress0_preempted"] = store.snapshot(0).progress[("rollout", 0)]
        first.proc.kill()
        first.stop()
        second = policy(1)
        store.open_barrier(1, timeout=STEP_TIMEOUT_S)
        found["next"] = _step(rollout, "next")
        found["sent1"] = second.wait_for("refit 1 sent", lambda m: m.get("sent") == 1, 60)
        found["progress1"] = store.snapshot(1).progress[("rollout", 0)]
        _step(rollout, "done", 120)
        found["rollout_exit"] = rollout.stop(60)
        yield found
    finally:
        for proc in [rollout, *policies]:
            if proc.proc.poll() is None:
                proc.proc.kill()
            proc.stop(10)


def test_vllm_tokens_equal_hf_generate_after_a_refit(scenario: dict[str, Any]) -> None:
    landed, sent = scenario["landed"], scenario["sent0"]
    # The reference is HF generate on the sent weights, computed by the trainer...
    assert landed["tokens"] == sent["expected"] == landed["expected"]
    # ...and the refit changed what vLLM serves (the check is not vacuous).
    assert landed["tokens"] != scenario["started"]["tokens"]
    # Generation went on while the refit streamed in: the checkpoint's tokens.
    assert all(batch == scenario["started"]["tokens"] for batch in landed["during"])


def test_the_refit_is_reported_with_its_phases_and_what_was_checked(
    scenario: dict[str, Any],
) -> None:
    progress, figures = scenario["progress0"], scenario["landed"]["figures"]
    assert progress.refits_completed == 1 and progress.verification == "tokens"
    assert progress.recent[-1].refit == 0 and progress.recent[-1].bytes == figures["bytes"]
    assert figures["bytes"] == scenario["sent0"]["bytes"] > 1 << 20
    assert figures["landing_s"] > 0 and figures["transfer_s"] > 0 and figures["verify_s"] > 0
    assert progress.message.startswith("refit 0 committed: transfer ")
    assert "landing" in progress.message and "verification" in progress.message
    # The version vLLM now serves (issue #32): the digest of the bytes the trainer sent,
    # as the commit's figures hand it to the server and the rank reports it.
    assert figures["digest"] == scenario["sent0"]["digest"], figures
    assert progress.serving is not None and progress.serving.refit == 0
    assert progress.serving.digest == figures["digest"]


def test_a_refit_preempted_mid_transfer_leaves_vllm_tokens_unchanged(
    scenario: dict[str, Any],
) -> None:
    preempted, refit0 = scenario["preempted"], scenario["landed"]["tokens"]
    assert preempted["error_type"] == "Preempted", preempted
    assert preempted["before"] == refit0
    assert all(batch == refit0 for batch in preempted["during"])
    assert preempted["after"] == refit0
    # The rank said so in its progress report; refit 0 stays the last one committed.
    progress = scenario["progress0_preempted"]
    assert progress.state == "preempted" and progress.refits_completed == 1


def test_the_next_refit_lands_through_vllms_weight_transfer_registry(
    scenario: dict[str, Any],
) -> None:
    nxt, sent = scenario["next"], scenario["sent1"]
    assert nxt["tokens"] == sent["expected"]
    assert nxt["tokens"] != scenario["landed"]["tokens"]
    progress = scenario["progress1"]
    assert progress.refits_completed == REFITS and progress.state == "done"
    # The backend claims its own read-back of every served layer (none is unprobed here).
    assert progress.verification == "served-params"
    # Every response from now on names the refit that produced it (issue #49).
    assert progress.serving is not None
    assert nxt["version"] == progress.serving.label, (nxt["version"], progress.serving)
    assert nxt["version"].startswith("refit-1@")
    assert scenario["rollout_exit"] == 0
