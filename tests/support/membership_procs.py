"""Helpers for the engine's membership tests (``tests/e2e/test_nixl_membership.py``): each
rank is a real process with a real NIXL (UCX) agent, driven step by step by the test.

A :class:`Rank` process runs one ``NIXLCheckpointEngine`` and executes the commands the
test puts in its queue (``prepare``, ``peers``, ``send``, ``receive``, ``exit``), answering
each with JSON; nothing crosses a process boundary but JSON strings.  The test plays the
rendezvous: it gathers the ranks' metadata and hands each rank the membership listing
(policy ranks, then rollout ranks, ``None`` for an absent one), as the session does.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import multiprocessing as mp
import os
import queue
import signal
import time
from typing import Any

from tests.support.engine_procs import digest, state_dict

CTX = mp.get_context("spawn")
#: Generous: starting a process (torch, nixl) takes minutes on a loaded 2-core machine.
PATIENCE_S = float(os.environ.get("REFIT_TEST_JOIN_TIMEOUT_S", "300"))
BUCKET = 64 << 10


def _handle(engine: Any, role: str, rank: int, cmd: dict[str, Any], out_q: Any) -> dict[str, Any]:
    op = cmd["op"]
    if op == "prepare":
        return {"meta": engine.prepare().model_dump_json()}
    if op == "peers":
        world = {"train_world_size": cmd["T"], "rollout_world_size": cmd["R"]}
        if engine._role is None:  # first membership: the upstream entry points
            if role == "policy":
                engine.init_policy_process_group(worker_rank=rank, metadata=cmd["listing"], **world)
            else:
                engine.init_rollout_process_group(
                    rollout_rank=rank, metadata=cmd["listing"], **world
                )
        update = engine.update_peers(cmd["listing"], version=cmd["version"], **world)
        return {
            "removed": [list(k) for k in update.remove],
            "added": [list(k) for k, _ in update.add],
        }
    if op == "send":
        timing = asyncio.run(
            engine.send_weights(iter(state_dict(cmd["refit"]).items()), refit_id=cmd["refit"])
        )
        return {
            "refit_id": timing.refit_id,
            "delivered": list(timing.delivered),
            "dropped": {str(k): v for k, v in timing.dropped.items()},
            "bytes": timing.bytes,
        }
    if op == "receive":
        return asyncio.run(_receive(engine, rank, cmd, out_q))
    raise ValueError(f"unknown command {op!r}")


async def _receive(engine: Any, rank: int, cmd: dict[str, Any], out_q: Any) -> dict[str, Any]:
    got: dict[str, str] = {}
    timings: list[Any] = []
    first = True
    async for batch in engine.receive_weight_batches(
        min_refit=cmd["min_refit"], on_complete=timings.append
    ):
        for name, tensor in batch:
            got[name] = digest(tensor.clone())
        if first and cmd.get("hold_s"):
            out_q.put(json.dumps({"event": "first_batch", "rank": rank}))
            await asyncio.sleep(cmd["hold_s"])
        first = False
    return {"refit_id": timings[0].refit_id, "digests": got}


def rank_main(role: str, rank: int, timeout_s: float, cmd_q: Any, out_q: Any) -> None:
    """Process entry point: run commands until ``exit``."""
    from refit_worker.engine import NIXLCheckpointEngine

    faulthandler.dump_traceback_later(4 * PATIENCE_S, exit=True)
    engine = NIXLCheckpointEngine(BUCKET, device="cpu", timeout_s=timeout_s)
    while True:
        cmd = json.loads(cmd_q.get(timeout=4 * PATIENCE_S))
        if cmd["op"] == "exit":
            engine.finalize()
            out_q.put(json.dumps({"op": "exit"}))
            return
        try:
            reply = _handle(engine, role, rank, cmd, out_q)
        except Exception as exc:  # reported to the test, which asserts on it
            reply = {"error": f"{type(exc).__name__}: {exc}", "error_type": type(exc).__name__}
        out_q.put(json.dumps({"op": cmd["op"], **reply}))


class Rank:
    """One rank's process and its two queues."""

    def __init__(self, role: str, rank: int, *, timeout_s: float) -> None:
        self.role, self.rank = role, rank
        self.cmd_q, self.out_q = CTX.Queue(), CTX.Queue()
        self.events: list[dict[str, Any]] = []
        self.proc = CTX.Process(
            target=rank_main,
            args=(role, rank, timeout_s, self.cmd_q, self.out_q),
            daemon=True,
        )
        self.proc.start()

    def ask(self, op: str, **args: Any) -> None:
        self.cmd_q.put(json.dumps({"op": op, **args}))

    def _next(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                return dict(json.loads(self.out_q.get(timeout=0.1)))
            if not self.proc.is_alive():
                raise RuntimeError(f"{self.role} rank {self.rank} died ({self.proc.exitcode})")
        raise TimeoutError(f"{self.role} rank {self.rank} did not answer within {timeout}s")

    def reply(self, timeout: float = PATIENCE_S) -> dict[str, Any]:
        """The answer to the last command (events seen meanwhile are kept)."""
        while True:
            message = self._next(timeout)
            if "event" in message:
                self.events.append(message)
                continue
            return message

    def event(self, name: str, timeout: float = PATIENCE_S) -> dict[str, Any]:
        message = self._next(timeout)
        if message.get("event") != name:
            raise AssertionError(f"expected event {name!r}, got {message}")
        return message

    def prepare(self) -> str:
        self.ask("prepare")
        return str(self.reply()["meta"])

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(timeout=10)

    def close(self) -> None:
        if self.proc.is_alive():
            self.ask("exit")
            with contextlib.suppress(Exception):
                self.reply(timeout=15)
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)


def set_peers(
    ranks: list[Rank], listing: list[str | None], *, T: int, R: int, versions: dict[int, int]
) -> list[dict[str, Any]]:
    """Hand every rank of ``ranks`` the listing (policy rank ``p`` gets ``versions[p]``,
    others version ``max``); their answers, each checked for errors."""
    for r in ranks:
        version = versions.get(r.rank, max(versions.values())) if r.role == "policy" else 0
        r.ask("peers", listing=listing, T=T, R=R, version=version)
    answers = [r.reply() for r in ranks]
    for r, answer in zip(ranks, answers, strict=True):
        assert "error" not in answer, f"{r.role} {r.rank}: {answer['error']}"
    return answers


def expected_digests(refit: int) -> dict[str, str]:
    return {name: digest(t) for name, t in state_dict(refit).items()}
