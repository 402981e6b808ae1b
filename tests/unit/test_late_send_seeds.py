"""The drain-hang interleaving of issue #29, forced: a rollout rank that committed a refit
waits for the policy's next send, but the policy sent that refit to the pod this one
replaced and is done, leaving late members to the rollout peer that stays.  The waiting
rank must notice the policy ranks are done and seed the refit from that peer; before
``30bd9e6`` it waited for a send that never came, failed, and the job never ended.

Real: a :class:`RolloutSession` and its membership and peer-seed decisions over the
file-backed rendezvous store, which the test writes as the coordinator and the other pods
would.  Stand-ins: the engine's receive (a send that never comes, as the policy sent it
elsewhere) and the NIXL READ of the seed (``pull``, covered over real NIXL in
``tests/e2e/test_peer_seeding.py``); the interleaving is what is under test here.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tests.support.operator_run import eventually

import refit_worker.rollout.peer_seeds as peer_seeds
from refit_worker import RolloutSession
from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig
from refit_worker.contract.entries import (
    BARRIER_KEY,
    BarrierEntry,
    MetadataEntry,
    ProgressEntry,
    RolloutMember,
    SeedPointer,
    meta_key,
    progress_key,
)
from refit_worker.engine.messages.wire import NixlAgentMetadata
from refit_worker.engine.planning.buckets import TensorSpec
from refit_worker.engine.rollout.seed_transfer import Seeded, SeedSource, pointer_metadata
from refit_worker.session.refits import CommittedRefit

REFITS = 6
#: The refit the policy sent to the replaced pod, not to this one: the job's last.
LAST = REFITS - 1
#: The longest the test waits for the session to act; it normally takes ~1 s (one
#: membership check), far inside the transfer timeout it would otherwise hit.
ACT_S = 20.0


class _NoSend:
    """An engine whose receive never completes: the policy sent the refit to another pod."""

    def __init__(self) -> None:
        self.waiting = asyncio.Event()
        self.cancelled = False
        # What peer seeding reads of an engine: its shared part (an unsigned job).
        self.common = SimpleNamespace(
            agent=object(), registry=object(), device=torch.device("cpu"), verifier=None
        )

    async def receive_into(self, targets: object, *, min_refit: int, delta: object) -> object:
        self.waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        raise AssertionError("unreachable: the event is never set")


def _uid() -> str:
    return str(uuid.uuid4())


class _Job:
    """The store as the coordinator and the other pods write it: one policy rank, rollout
    rank 0 (the peer that stays) and rank 1 (the session under test)."""

    def __init__(self, tmp_path: Path) -> None:
        self.policy_uid, self.peer_uid, self.my_uid = _uid(), _uid(), _uid()
        self.config = WorkerConfig(
            job="late-send",
            role="rollout",
            rank=1,
            policy_world_size=1,
            rollout_world_size=2,
            generation=1,  # the drain's replacement
            pod_uid=self.my_uid,
            pod_name="late-send-rollout-1",
            transfer=TransferConfig(
                bucket_size=1 << 20, device="cpu", refits=REFITS, timeout_seconds=300
            ),
            rendezvous=RendezvousConfig(store="file", location=str(tmp_path / "store")),
        )
        self.session = RolloutSession(self.config)
        self.store = self.session.store
        self.store.put_entry(
            BARRIER_KEY,
            BarrierEntry(
                epoch=0,
                policy_uids=(self.policy_uid,),
                rollout=(
                    RolloutMember(uid=self.peer_uid),
                    RolloutMember(uid=self.my_uid, generation=1),
                ),
            ),
        )
        agent = NixlAgentMetadata(agent_name="rollout-0", agent_metadata=b"peer").model_dump_json()
        pointer = SeedPointer(addr=4096, nbytes=512, metadata=pointer_metadata(b"region"))
        self.store.put_entry(
            meta_key("rollout", 0),
            MetadataEntry(
                epoch=0, uid=self.peer_uid, role="rollout", rank=0, agent=agent, seed=pointer
            ),
        )
        # The peer committed the last refit and stays to seed late members.
        self._progress("rollout", 0, self.peer_uid, "done", REFITS, seeding=True)

    def _progress(
        self, role: str, rank: int, uid: str, state: str, refits: int, *, seeding: bool = False
    ) -> None:
        entry = ProgressEntry(
            epoch=0,
            uid=uid,
            role=role,  # type: ignore[arg-type]
            rank=rank,
            state=state,  # type: ignore[arg-type]
            refits_completed=refits,
            seeding=seeding,
        )
        self.store.put_entry(progress_key(role, rank), entry)  # type: ignore[arg-type]

    def policy(self, state: str, refits: int, *, seeding: bool = False) -> None:
        self._progress("policy", 0, self.policy_uid, state, refits, seeding=seeding)


class _Looks:
    """Counts the session's own checks of whether the policy ranks are done, and what
    each said (the real check, over the store)."""

    def __init__(self, job: _Job) -> None:
        self.said: list[bool] = []
        self._real = job.session._seeds.policy_gone
        job.session._seeds.policy_gone = self  # type: ignore[method-assign]

    def __call__(self, barrier: BarrierEntry) -> bool:
        gone = self._real(barrier)
        self.said.append(gone)
        return gone

    async def seen(self, count: int) -> None:
        """Until the session checked ``count`` times (each ~1 s apart, between polls)."""
        what = f"the session's check #{count} of the policy ranks"
        await eventually(lambda: len(self.said) >= count, what, timeout=ACT_S)


def _targets(specs: Sequence[TensorSpec]) -> Mapping[str, torch.Tensor]:
    return {}


class _Pulls:
    """``pull``'s stand-in: records what each READ would have been asked, and what the
    policy's report said at that moment."""

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.calls: list[tuple[list[str], int, str]] = []

    async def __call__(
        self, agent: Any, registry: Any, device: Any, sources: list[SeedSource], **kw: Any
    ) -> Seeded:
        policy = self.job.store.progress_all()[("policy", 0)]
        self.calls.append(([s.label for s in sources], kw["min_refit"], policy.state))
        return Seeded({}, LAST, tuple(s.label for s in sources), 512, 0.01)


@pytest.fixture
def job(tmp_path: Path) -> Any:
    made = _Job(tmp_path)
    try:
        yield made
    finally:
        made.session.connection._engine = None  # the stand-in holds nothing to free
        made.session.close()


class _Waiting:
    """Rollout rank 1 waiting for the policy's send of the last refit, after two of its
    checks of the policy ranks said they are not done (it has not seeded)."""

    def __init__(self, job: _Job, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pulls = _Pulls(job)
        monkeypatch.setattr(peer_seeds, "pull", self.pulls)
        self.looks, self.engine = _Looks(job), _NoSend()
        # The drain's replacement seeded refit LAST - 1 earlier; it now waits for LAST.
        job.session._committed = CommittedRefit(LAST - 1, {})  # type: ignore[arg-type]
        job.session.connection._engine = self.engine  # type: ignore[assignment]
        self.arriving = asyncio.ensure_future(
            job.session._arrive(self.engine, _targets, LAST, current=False)  # type: ignore[arg-type]
        )

    async def started(self) -> None:
        await eventually(self.engine.waiting.is_set, "the rank to wait for the send", ACT_S)
        await self.looks.seen(2)
        assert self.looks.said[:2] == [False, False]
        assert not self.arriving.done() and self.pulls.calls == []


async def test_a_rank_waiting_for_a_send_seeds_it_once_the_policy_ranks_are_done(
    job: _Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The policy is still sending its last refit (to the replaced pod): no seed yet.
    job.policy("running", LAST)
    rank = _Waiting(job, monkeypatch)
    await rank.started()
    # The policy ranks finish and leave late members to rollout-0, which stays.
    job.policy("done", REFITS)
    await eventually(rank.arriving.done, "the rank to seed the refit from rollout-0", ACT_S)
    received = rank.arriving.result()
    assert (received.timing.refit_id, received.timing.bytes) == (LAST, 512)
    assert rank.engine.cancelled, "the wait for the send was not given up"
    assert rank.looks.said[-1] is True and rank.looks.said.count(True) == 1
    assert rank.pulls.calls == [(["rollout-0"], LAST, "done")]
    assert job.session._seeded_from == ("rollout-0",)


async def test_a_policy_rank_that_stays_to_send_is_waited_for(
    job: _Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A policy rank that reports done but stays to serve late members (``seeding``) will
    send: the rank keeps waiting for it rather than seeding.  Cancelling that wait stops
    the receive too (``Connection.watched`` left it running until this test)."""
    job.policy("done", REFITS, seeding=True)
    rank = _Waiting(job, monkeypatch)
    await rank.started()
    rank.arriving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await rank.arriving
    assert rank.engine.cancelled
