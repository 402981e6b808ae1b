"""Helpers for the receive-mode tests: ``RefitSession`` ranks as real processes.

Each rank is a separate process (multiprocessing spawn) running a real ``RefitSession``
over the file-backed rendezvous store; the test opens the barrier as the operator would.
Transfers are real NIXL (UCX) WRITEs; preemption is a real SIGTERM sent with ``os.kill``.
The only test hooks: a policy rank can be told to stop sending after its first bucket
(``pause_at``), so that a refit is reliably caught half-way; it reports ``paused`` then.
And with delta refits (``delta="auto"``), to flip one bit of one delta after it was encoded
(``corrupt_at``): the trainer's digest stays true, so the replica must catch it.
Results cross back as JSON in queues.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import faulthandler
import json
import multiprocessing as mp
import queue
import signal
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tests.support.engine_procs import digest, state_dict

CTX = mp.get_context("spawn")
PATIENCE_S = 90.0


@dataclass
class SessionJob:
    mode: str  # "receive", "double_buffer", "in_place" or "pool" (see ``_from_pool``)
    refits: int = 3
    bucket_size: int = 64 << 10
    timeout_s: float = 20.0
    pause_at: int = -1  # the policy stops after the first bucket of this refit
    wrong_shape: str = ""  # the rollout's target has this tensor with one more row
    store: str = ""
    device: str = "cpu"
    #: Per refit, which names the policy sends: "A" the state dict as it is, "B" with
    #: ``big.weight`` split by rows into two names (as per-expert names split a fused
    #: tensor); "" sends "A" every refit.
    layouts: str = ""
    #: ``transfer.delta`` ("on", "auto"; "" leaves it unset).
    delta: str = ""
    #: Each refit changes this share of the elements of refit 0's state (0: every refit
    #: is a new random state).
    changes: float = 0.0
    corrupt_at: int = -1  # the delta of this refit gets one flipped bit (see the module)
    #: The ranks hold the job's key halves (policy: private, rollout: public).
    signed: bool = False
    #: From this refit on, the policy's sends are sealed by a key that claims the job's
    #: fingerprint but is another: a hostile process in its place (see ``_forge_from``).
    forge_at: int = -1


#: The job's key in these tests (a fixed seed: both processes derive the same halves).
JOB_SEED = bytes(range(32))


def _config(job: SessionJob, role: str) -> Any:
    from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig

    return WorkerConfig(
        job="modes",
        role=role,  # type: ignore[arg-type]
        rank=0,
        policy_world_size=1,
        rollout_world_size=1,
        pod_uid=str(uuid.uuid4()),
        pod_name=f"modes-{role}-0",
        transfer=TransferConfig(
            bucket_size=job.bucket_size,
            timeout_seconds=job.timeout_s,
            device=job.device,  # type: ignore[arg-type]
            delta=job.delta or None,  # type: ignore[arg-type]
            refits=job.refits,  # a rank that reports "done" is owed nothing more
        ),
        rendezvous=RendezvousConfig(store="file", location=job.store),
        **_keys(job, role),
    )


def _keys(job: SessionJob, role: str) -> dict[str, str]:
    from refit_worker.engine.messages.signing import RefitSigner

    if not job.signed:
        return {}
    signer = RefitSigner(JOB_SEED)
    if role == "policy":
        return {"signing_key": base64.b64encode(JOB_SEED).decode()}
    return {"verify_key": base64.b64encode(signer.public).decode()}


def _forge_from_now(session: Any) -> None:
    """Seal this policy rank's sends with a hostile key that names the job's: the refit
    (or delta) is self-consistent, every hash matches its bytes, only the key is wrong."""
    from refit_worker.engine.messages.signing import RefitSigner

    hostile = RefitSigner.generate()
    hostile.fingerprint = RefitSigner(JOB_SEED).fingerprint
    session.connection.engine.common.signer = hostile


def _pause_after_first_bucket(out_q: Any) -> None:
    """Make this policy rank stop sending after the first bucket of the refit."""
    from refit_worker.engine.policy import refit_send as sender

    original = sender.RefitSender._send_bucket

    async def send_then_stall(self: Any, stream: Any, seq: int) -> None:
        await original(self, stream, seq)
        self.agent.flush()
        out_q.put(json.dumps({"role": "policy", "paused": seq}))
        await asyncio.sleep(3600)

    sender.RefitSender._send_bucket = send_then_stall  # type: ignore[method-assign]


def _corrupt_next_delta() -> None:
    """Flip one bit of a value in the next delta this policy rank encodes."""
    from refit_worker.policy import delta_source

    original = delta_source.encode_delta

    def encode_then_flip(*args: Any, **kwargs: Any) -> Any:
        delta = original(*args, **kwargs)
        delta.data[delta.entries[0].values_offset] ^= 0x10
        delta_source.encode_delta = original
        return delta

    delta_source.encode_delta = encode_then_flip  # type: ignore[assignment]


def _record_rejections(session: Any, report: dict[str, Any]) -> None:
    """Note what this rollout rank served when it rejected a delta."""
    from refit_worker.engine.delta.codec import DeltaRejectedError
    from refit_worker.rollout import delta_base

    original = delta_base.apply_delta

    def apply_and_note(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except DeltaRejectedError as exc:
            served = session.served_version
            report["rejected"].append(
                {
                    "error": str(exc),
                    "committed": session.committed.refit_id,
                    "served": None if served is None else served.refit,
                    "live": {n: digest(t) for n, t in session.committed.state.items()},
                }
            )
            raise

    delta_base.apply_delta = apply_and_note  # type: ignore[assignment]


def _live(refit: int, wrong_shape: str, device: str) -> dict[str, torch.Tensor]:
    live = {n: torch.empty_like(t, device=device) for n, t in state_dict(refit).items()}
    if wrong_shape:
        t = live[wrong_shape]
        live[wrong_shape] = torch.empty(
            (t.shape[0] + 1, *t.shape[1:]), dtype=t.dtype, device=device
        )
    return live


def sent_digests(job: SessionJob, refit: int) -> dict[str, str]:
    """What the rollout must hold after ``refit``: the digests of what was sent."""
    return {n: digest(t) for n, t in _sent(job, refit).items()}


def _sent(job: SessionJob, refit: int) -> dict[str, torch.Tensor]:
    """What the policy sends in ``refit`` (see ``SessionJob.layouts`` and ``changes``)."""
    if job.changes:
        from refit_worker.pod.weights import advance

        state = state_dict(0)
        for step in range(1, refit + 1):
            advance(state, step, job.changes)
    else:
        state = state_dict(refit)
    sent = {n: t.to(job.device) for n, t in state.items()}
    if job.layouts and job.layouts[refit] == "B":
        top, bottom = sent.pop("big.weight").chunk(2)
        sent["big.top"], sent["big.bottom"] = top.contiguous(), bottom.contiguous()
    return sent


_POOL_BYTES = 1 << 20
_ALIGN = 64


def _from_pool(pool: bytearray, sent: dict[str, torch.Tensor], whole: bool) -> dict[str, Any]:
    """Tensors shaped as ``sent``, carved out of ``pool`` (memory this process reuses, as an
    allocator does): ``whole``: views, from the pool's second half on, of one storage over
    the whole pool; else each its own storage in the first half, from offset 4096 on.  So
    the storages of the one layout lie inside the other's, before its tensors."""
    out: dict[str, torch.Tensor] = {}
    base = len(pool) // 2 if whole else 4096
    every = torch.frombuffer(pool, dtype=torch.uint8)
    for name, t in sent.items():
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            out[name] = torch.empty_like(t)
            continue
        raw = (
            every[base : base + nbytes]
            if whole
            else torch.frombuffer(pool, dtype=torch.uint8, count=nbytes, offset=base)
        )
        out[name] = raw.view(t.dtype).view(t.shape)
        base += -(-nbytes // _ALIGN) * _ALIGN
    if base > len(pool):
        raise ValueError(f"the pool of {len(pool)} bytes cannot hold {base}")
    return out


def rank_main(job_json: str, role: str, out_q: Any) -> None:
    """Process entry point: run the job's refits as ``role``; report JSON."""
    from refit_worker import Preempted, RefitSession
    from refit_worker.rollout.targets import PartialRefitError

    job = SessionJob(**json.loads(job_json))
    faulthandler.dump_traceback_later(0.95 * PATIENCE_S, exit=True)
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    report: dict[str, Any] = {"role": role, "refits": [], "pointers": [], "rejected": []}
    session = RefitSession(_config(job, role), stop_requested=lambda: stop["flag"])
    if role == "rollout" and job.delta:  # "on" or "auto"
        _record_rejections(session, report)
    live = _live(0, job.wrong_shape, job.device)
    pool = bytearray(_POOL_BYTES)
    try:
        session.connect()
        for refit in range(job.refits):
            if role == "policy":
                if refit == job.pause_at:
                    _pause_after_first_bucket(out_q)
                if refit == job.corrupt_at:
                    _corrupt_next_delta()
                if refit == job.forge_at:
                    _forge_from_now(session)
                sent = _sent(job, refit)
                stats = asyncio.run(session.send(sent.items(), refit_id=refit))
                report["refits"].append({"bytes": stats.bytes})
                continue
            if job.mode == "receive":
                asyncio.run(session.receive(refit_id=refit))
            elif job.mode == "pool":
                whole = bool(job.layouts) and job.layouts[refit] == "B"
                live = _from_pool(pool, _sent(job, refit), whole)
                asyncio.run(session.receive_into(live, refit_id=refit, mode="in_place"))
            else:
                asyncio.run(session.receive_into(live, refit_id=refit, mode=job.mode))  # type: ignore[arg-type]
            committed = session.committed
            assert committed is not None and committed.refit_id == refit
            report["refits"].append({n: digest(t) for n, t in committed.state.items()})
            served = session.served_version
            report.setdefault("signed_by", []).append(served.signed_by if served else None)
            report["pointers"].append({n: t.data_ptr() for n, t in live.items() if t.numel()})
    except (Preempted, PartialRefitError, Exception) as exc:
        report["error_type"] = type(exc).__name__
        report["error"] = str(exc)
        report["weights_partial"] = getattr(exc, "weights_partial", None)
    # A rollout rank's own state: a policy session has none.
    report["live_weights_partial"] = getattr(session, "live_weights_partial", None)
    report["live"] = {n: digest(t) for n, t in live.items()}
    with contextlib.suppress(Exception):
        session.close()
    out_q.put(json.dumps(report))


def run_session_job(
    job: SessionJob,
    tmp: Path,
    on_paused: Any = None,
    expect: tuple[str, ...] = ("policy", "rollout"),
) -> dict[str, Any]:
    """Start both ranks, open the barrier, collect the ``expect``-ed reports; never hangs.

    ``on_paused(procs)`` runs when the policy says it stalled (see ``pause_at``); ranks that
    are still running once the expected reports are in are killed.
    """
    from refit_worker.rendezvous import FileStore, Layout

    job.store = str(tmp / "rdzv")
    out_qs = {role: CTX.Queue() for role in ("policy", "rollout")}
    procs = {
        role: CTX.Process(target=rank_main, args=(json.dumps(asdict(job)), role, out_qs[role]))
        for role in out_qs
    }
    for proc in procs.values():
        proc.start()
    reports: dict[str, Any] = {}
    try:
        FileStore(Path(job.store), Layout(1, 1, 1)).open_barrier(0, timeout=60)
        deadline = time.monotonic() + PATIENCE_S
        while any(r not in reports and procs[r].exitcode in (None, 0) for r in expect):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(procs) - set(reports))} did not report")
            for role, out_q in out_qs.items():
                with contextlib.suppress(queue.Empty):
                    message = json.loads(out_q.get(timeout=0.05))
                    if "paused" in message:
                        if on_paused is not None:
                            on_paused(procs)
                    else:
                        reports[role] = message
    finally:
        for proc in procs.values():
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    return reports
