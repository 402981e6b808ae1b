"""The worker entrypoint as real processes: 2 policy + 2 rollout ranks of ``refit-worker``,
real gloo groups, real NIXL (UCX) transfers, the file-backed rendezvous store.  The test
plays the coordinator (opens the barrier, posts a preemption notice); nothing is emulated.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from tests.support.processes import free_port

from refit_worker.contract.config import (
    RendezvousConfig,
    SafetensorsWeights,
    SyntheticWeights,
    TransferConfig,
    WorkerConfig,
)
from refit_worker.contract.exits import EXIT_BAD_CONFIG, EXIT_NOT_RETRYABLE, EXIT_PREEMPTED
from refit_worker.contract.rendezvous import Layout, make_preempt_notice
from refit_worker.rendezvous import FileStore

ROOT = Path(__file__).resolve().parents[2]


def _start_gang(
    tmp_path: Path,
    *,
    policy: int,
    rollout: int,
    refits: int,
    weights: SyntheticWeights,
    first_refit: int = 0,
) -> tuple[list[subprocess.Popen[bytes]], FileStore]:
    store_dir = tmp_path / "rdzv"
    ports = {"policy": free_port(), "rollout": free_port()}
    procs = []
    for role, world in (("policy", policy), ("rollout", rollout)):
        for rank in range(world):
            config = WorkerConfig(
                job="e2e",
                role=role,
                rank=rank,
                policy_world_size=policy,  # type: ignore[arg-type]
                rollout_world_size=rollout,
                pod_uid=str(uuid.uuid4()),
                pod_name=f"e2e-{role}-{rank}",
                master_port=ports[role],
                first_refit=first_refit,
                weights=weights,
                transfer=TransferConfig(bucket_size=64 << 10, refits=refits, timeout_seconds=30),
                rendezvous=RendezvousConfig(store="file", location=str(store_dir)),
            )
            env = {
                **os.environ,
                **config.to_env(),
                "PYTHONPATH": os.pathsep.join([str(ROOT / "worker"), str(ROOT / "operator")]),
            }
            log = (tmp_path / f"{role}-{rank}.log").open("wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "refit_worker"],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs, FileStore(store_dir, Layout(policy, rollout, 1))


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    return codes


def _logs(tmp_path: Path) -> str:
    logs = sorted(tmp_path.glob("*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs)


def test_two_by_two_three_refits_verified(tmp_path: Path) -> None:
    weights = SyntheticWeights(layers=2, hidden=64, vocab=256, dtype="bfloat16", seed=3)
    procs, store = _start_gang(tmp_path, policy=2, rollout=2, refits=3, weights=weights)
    store.open_barrier(0, timeout=60)
    codes = _wait_all(procs, timeout=120)
    assert codes == [0, 0, 0, 0], _logs(tmp_path)
    snap = store.snapshot(0)
    rollout = [snap.progress[("rollout", r)] for r in range(2)]
    assert all(p.state == "done" and p.refits_completed == 3 for p in rollout)
    assert all(p.bytes_total > 0 for p in rollout)
    # The rollout log says each refit was committed after the bit-exact check.
    for rank in range(2):
        text = (tmp_path / f"rollout-{rank}.log").read_text()
        assert [f"refit {k} committed" in text for k in range(3)] == [True] * 3


def test_a_gang_with_no_refit_left_finishes_without_connecting(tmp_path: Path) -> None:
    """A gang recreated after the last commit (a drain that met the final refit) has
    nothing to move: every rank reports done and exits 0 at once.  No rank publishes
    metadata or waits for a barrier (nobody opens one here), so none can reach for a peer
    that already left."""
    weights = SyntheticWeights(layers=2, hidden=64, vocab=256, dtype="bfloat16", seed=3)
    procs, store = _start_gang(
        tmp_path, policy=1, rollout=2, refits=3, weights=weights, first_refit=3
    )
    codes = _wait_all(procs, timeout=25)  # under the 30 s barrier timeout
    assert codes == [0, 0, 0], _logs(tmp_path)
    snap = store.snapshot(0)
    assert not snap.meta and snap.barrier is None, snap
    for member in (("policy", 0), ("rollout", 0), ("rollout", 1)):
        report = snap.progress[member]
        assert (report.state, report.refits_completed, report.bytes_total) == ("done", 3, 0)
    assert "nothing to connect for" in _logs(tmp_path)


def test_preemption_notice_stops_every_rank(tmp_path: Path) -> None:
    # Enough refits that the job is still running when the notice comes.
    weights = SyntheticWeights(layers=4, hidden=128, vocab=512, dtype="float32", seed=1)
    procs, store = _start_gang(tmp_path, policy=1, rollout=2, refits=10_000, weights=weights)
    store.open_barrier(0, timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        snap = store.snapshot(0)
        if any(p.refits_completed >= 1 for p in snap.progress.values()):
            break
        time.sleep(0.1)
    else:
        pytest.fail("no refit completed within 60 s:\n" + _logs(tmp_path))
    store.post_preemption(make_preempt_notice(0, "e2e-rollout-1", "uid", "drain"))
    codes = _wait_all(procs, timeout=60)
    assert codes == [EXIT_PREEMPTED] * 3, _logs(tmp_path)
    states = {k: p.state for k, p in store.snapshot(0).progress.items()}
    assert set(states.values()) == {"preempted"}, states


def test_signal_to_one_rank_stops_the_gang(tmp_path: Path) -> None:
    weights = SyntheticWeights(layers=2, hidden=64, vocab=128, dtype="float16", seed=2)
    procs, store = _start_gang(tmp_path, policy=2, rollout=1, refits=10_000, weights=weights)
    store.open_barrier(0, timeout=60)
    deadline = time.monotonic() + 60
    while not any(p.refits_completed >= 1 for p in store.snapshot(0).progress.values()):
        assert time.monotonic() < deadline, _logs(tmp_path)
        time.sleep(0.1)
    # A drain: policy rank 1's pod gets the signal, and the operator, seeing that pod go,
    # posts the job-wide notice.  Every rank of both roles stops as preempted, including
    # those whose transfer or collective broke because rank 1 left first.
    os.kill(procs[1].pid, signal.SIGTERM)
    store.post_preemption(make_preempt_notice(0, "e2e-policy-1", "uid", "signal"))
    codes = _wait_all(procs, timeout=60)
    assert codes == [EXIT_PREEMPTED] * 3, _logs(tmp_path)


def test_signal_while_waiting_for_the_barrier_stops_at_once(tmp_path: Path) -> None:
    # The policy pod died at start-up, so the barrier never opens; the operator deletes the
    # gang and the rollout pod gets its signal while it waits.  It must stop well within a
    # grace period, not sit out the 30 s barrier timeout and be SIGKILLed.
    weights = SyntheticWeights(layers=1, hidden=32, vocab=64, dtype="float32", seed=4)
    procs, store = _start_gang(tmp_path, policy=1, rollout=1, refits=3, weights=weights)
    procs[0].kill()
    procs[0].wait(10)
    deadline = time.monotonic() + 60
    while ("rollout", 0) not in store.snapshot(0).meta:  # published: now waiting
        assert procs[1].poll() is None and time.monotonic() < deadline, _logs(tmp_path)
        time.sleep(0.05)
    os.kill(procs[1].pid, signal.SIGTERM)
    try:
        code = procs[1].wait(timeout=10)
    finally:
        _wait_all(procs, timeout=0)
    assert code == EXIT_PREEMPTED, _logs(tmp_path)
    assert "stop requested while waiting for the barrier of epoch 0" in _logs(tmp_path)
    assert store.snapshot(0).progress[("rollout", 0)].state == "preempted"


def _run_rank(config: WorkerConfig, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """One ``refit-worker`` rank to its end, its env from ``config`` (plus ``extra_env``)."""
    env = {
        **os.environ,
        **config.to_env(),
        **extra_env,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "worker"), str(ROOT / "operator")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "refit_worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("variable", "bad"),
    [
        *(
            ("REFIT_PREEMPTION_SIGNAL", bad)
            for bad in ("SIGBOGUS", "SIGKILL", "USR1,usr1", "USR1,")
        ),
        # Issue #50: a time that once overflowed in the gang, a bucket below one element.
        ("REFIT_TRANSFER", '{"timeout_seconds": 1e308}'),
        ("REFIT_TRANSFER", '{"bucket_size": 1}'),
    ],
)
def test_a_bad_env_exits_2_before_joining_anything(tmp_path: Path, variable: str, bad: str) -> None:
    # Rank 1 of a two-rank role would connect to rank 0's store at master_addr:master_port:
    # the test listens there, so a connection would show the worker went on to join.
    with socket.socket() as master:
        master.bind(("127.0.0.1", 0))
        master.listen()
        master.setblocking(False)
        config = WorkerConfig(
            job="e2e",
            role="policy",
            rank=1,
            policy_world_size=2,
            rollout_world_size=1,
            pod_uid=str(uuid.uuid4()),
            master_port=master.getsockname()[1],
            transfer=TransferConfig(timeout_seconds=30),
            rendezvous=RendezvousConfig(store="file", location=str(tmp_path / "rdzv")),
        )
        done = _run_rank(config, **{variable: bad})
        with pytest.raises(BlockingIOError):
            master.accept()  # nobody knocked
    # Exit 2 is one of the codes that fail the job at once (exits.NOT_RETRYABLE).
    assert done.returncode == EXIT_BAD_CONFIG, done.stderr
    assert variable in done.stderr
    assert not (tmp_path / "rdzv").exists()  # nor opened the rendezvous


def _uint16_checkpoint(tmp_path: Path) -> dict[str, Any]:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state = {
        "embed.weight": torch.ones(8, 4, dtype=torch.bfloat16),
        "router.counts": torch.zeros(16, dtype=torch.uint16),
    }
    save_file(state, str(ckpt / "model.safetensors"))
    return {"weights": SafetensorsWeights(path=str(ckpt))}


@pytest.mark.parametrize(
    ("setup", "error", "names", "reported"),
    [
        (
            _uint16_checkpoint,
            "UnsupportedWeightsError",
            ["model.safetensors", "tensor 'router.counts' has dtype uint16"],
            True,
        ),
        (
            lambda tmp: {"weights": SafetensorsWeights(path=str(tmp / "no-such-dir"))},
            "MissingWeightsError",
            ["no-such-dir does not exist"],
            True,
        ),
        (
            lambda tmp: {"transfer": TransferConfig(timeout_seconds=30, backend="NOSUCH")},
            "UnknownBackendError",
            ["NIXL backend 'NOSUCH' is not available"],
            True,
        ),
        (
            lambda tmp: {"transfer": TransferConfig(timeout_seconds=30, release_after_refit=True)},
            "RefusedConfigError",
            ["transfer.releaseAfterRefit is not supported"],
            False,  # refused while building the session: nothing to report with
        ),
    ],
    ids=["uint16-tensor", "missing-checkpoint", "unknown-backend", "release-after-refit"],
)
def test_a_failure_no_restart_can_cure_exits_84_and_says_why_in_one_line(
    tmp_path: Path,
    setup: Callable[[Path], dict[str, Any]],
    error: str,
    names: list[str],
    reported: bool,
) -> None:
    """A rank that can never succeed on its input exits 84 (the operator fails the job at
    once) and its termination message names the cause in one line; it fails before it
    publishes any metadata, so no peer ever connects to it."""
    termination = tmp_path / "termination-log"
    store_dir = tmp_path / "rdzv"
    config = WorkerConfig(
        job="e2e",
        role="policy",
        rank=0,
        policy_world_size=1,
        rollout_world_size=1,
        pod_uid=str(uuid.uuid4()),
        pod_name="e2e-policy-0",
        master_port=free_port(),
        transfer=TransferConfig(timeout_seconds=30),
        rendezvous=RendezvousConfig(store="file", location=str(store_dir)),
        termination_message_path=str(termination),
    ).model_copy(update=setup(tmp_path))
    done = _run_rank(config)
    assert done.returncode == EXIT_NOT_RETRYABLE, done.stdout + done.stderr
    message = termination.read_text()
    assert message.startswith(f"{error}: ") and "\n" not in message, message
    assert all(name in message for name in names), message
    snap = FileStore(store_dir, Layout(1, 1, 1)).snapshot(0)
    assert not snap.meta, snap
    report = snap.progress.get(("policy", 0))
    assert (report.state if report else None) == ("failed" if reported else None), snap
