"""Peer seeding over real NIXL: peers in their own processes offer a committed state, this
process READs it, striped over them, and checks every tensor; a copy that changed after
it was offered, or no offer new enough, gives a :class:`SeedError`, never a state.

The peers are ``tests/support/seed_procs.py`` processes (a NIXL agent each, over UCX).
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

import pytest
import torch
from tests.support.seed_procs import expected_state

from refit_worker.engine import NIXLCheckpointEngine, RefitTiming
from refit_worker.engine.base import dtype_from_name
from refit_worker.engine.messages.signing import RefitSigner, RefitVerifier, SealRecord
from refit_worker.engine.messages.wire import NixlAgentMetadata
from refit_worker.engine.planning.buckets import TensorSpec
from refit_worker.engine.rollout.seed_transfer import Seeded, SeedError, SeedSource, pull
from refit_worker.engine.transport.agent import NixlAgent
from refit_worker.engine.transport.registry import MemoryRegistry

REFIT = 4


class _Peer:
    def __init__(self, label: str, refit: int) -> None:
        self.label = label
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.seed_procs", str(refit)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        offer = json.loads(self._answer("{"))
        self.source = SeedSource(
            label,
            NixlAgentMetadata.model_validate_json(offer["agent"]),
            tuple(offer["region"]),  # type: ignore[arg-type]
            base64.b64decode(offer["metadata"]),
        )

    def _answer(self, start: str) -> str:
        """The peer's next line starting with ``start`` (NIXL logs to stdout too)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(start):
                return line
        raise AssertionError(f"{self.label} exited (rc {self.proc.wait(timeout=30)})")

    def tell(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        assert self._answer("ok").strip() == "ok", f"{self.label}: {command}"

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def peers() -> Iterator[list[_Peer]]:
    started = [_Peer("rollout-1", REFIT), _Peer("rollout-2", REFIT)]
    try:
        yield started
    finally:
        for peer in started:
            peer.stop()


@pytest.fixture(scope="module")
def reader() -> tuple[NixlAgent, MemoryRegistry]:
    agent = NixlAgent()
    return agent, MemoryRegistry(agent, "DRAM")


def _fresh(specs: Sequence[TensorSpec]) -> Mapping[str, torch.Tensor]:
    return {s.name: torch.zeros(s.shape, dtype=dtype_from_name(s.dtype)) for s in specs}


async def _seed(
    reader: tuple[NixlAgent, MemoryRegistry],
    sources: Sequence[SeedSource],
    min_refit: int,
    key: RefitSigner | None = None,
) -> Seeded:
    """Seed from ``sources``; with ``key``: only what that key's seals pin."""
    agent, registry = reader
    return await pull(
        agent,
        registry,
        torch.device("cpu"),
        sources,
        min_refit=min_refit,
        resolve=_fresh,
        timeout_s=20,
        verifier=RefitVerifier(key.public) if key is not None else None,
    )


def _bit_exact(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


async def test_a_seed_striped_over_two_peers_is_bit_exact(
    peers: list[_Peer], reader: tuple[NixlAgent, MemoryRegistry]
) -> None:
    seeded = await _seed(reader, [p.source for p in peers], min_refit=2)
    want = expected_state(REFIT)
    assert seeded.refit == REFIT
    assert set(seeded.sources) == {"rollout-1", "rollout-2"}  # both peers gave a share
    assert seeded.bytes == sum(t.numel() * t.element_size() for t in want.values())
    _bit_exact(seeded.tensors, want)


async def test_no_offer_new_enough_is_no_seed(
    peers: list[_Peer], reader: tuple[NixlAgent, MemoryRegistry]
) -> None:
    with pytest.raises(SeedError, match=rf"no peer offers a refit >= {REFIT + 1} \(offered: \[4"):
        await _seed(reader, [p.source for p in peers], min_refit=REFIT + 1)


async def test_a_copy_changed_after_its_offer_is_refused_then_a_new_offer_seeds(
    peers: list[_Peer], reader: tuple[NixlAgent, MemoryRegistry]
) -> None:
    name = next(iter(expected_state(REFIT)))
    peer = peers[0]
    peer.tell(f"corrupt {name}")  # the bytes move on; the manifest still says refit 4
    with pytest.raises(SeedError, match=f"{name!r} of refit {REFIT} does not match its hash"):
        await _seed(reader, [peer.source], min_refit=REFIT)
    # Its next commit is offered anew (the region is rewritten in place): read again, it
    # seeds that refit, whole and exact.
    peer.tell("corrupt " + name)  # the flip undone: the state is refit 4's again
    peer.tell(f"offer {REFIT + 2}")
    seeded = await _seed(reader, [peer.source], min_refit=REFIT)
    assert (seeded.refit, seeded.sources) == (REFIT + 2, ("rollout-1",))
    _bit_exact(seeded.tensors, expected_state(REFIT + 2))


# -- seeds under the job's key (issue #50): a peer cannot vouch for its own copy ---------

JOB_KEY = RefitSigner.generate()


async def _signed_refit_seals(state: Mapping[str, torch.Tensor]) -> list[SealRecord]:
    """The seals a rollout rank keeps from a real signed refit of ``state`` (small buckets:
    tensors split over several, each piece under the seal)."""
    policy = NIXLCheckpointEngine(4096, device="cpu", checksum=True, signer=JOB_KEY)
    rollout = NIXLCheckpointEngine(
        4096, device="cpu", checksum=True, verifier=RefitVerifier(JOB_KEY.public)
    )
    metadata = [policy.prepare().model_dump_json(), rollout.prepare().model_dump_json()]
    policy.init_policy_process_group(
        worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata
    )
    rollout.init_rollout_process_group(
        rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata
    )
    timings: list[RefitTiming] = []

    async def drain() -> None:
        async for _batch in rollout.receive_weight_batches(
            refit_id=REFIT, on_complete=timings.append
        ):
            pass

    try:
        await asyncio.gather(policy.send_weights(iter(state.items()), refit_id=REFIT), drain())
    finally:
        policy.finalize()
        rollout.finalize()
    assert timings[0].signed_by == JOB_KEY.fingerprint
    return list(timings[0].seals)


@pytest.fixture(scope="module")
async def sealed_peer() -> AsyncIterator[tuple[_Peer, list[SealRecord]]]:
    seals = await _signed_refit_seals(expected_state(REFIT))
    peer = _Peer("rollout-3", REFIT)
    try:
        peer.tell("seals " + json.dumps([s.model_dump(mode="json") for s in seals]))
        yield peer, seals
    finally:
        peer.stop()


async def _signed_seed(
    reader: tuple[NixlAgent, MemoryRegistry], source: SeedSource, key: RefitSigner = JOB_KEY
) -> Seeded:
    return await _seed(reader, [source], REFIT, key)


async def test_a_seed_is_checked_against_the_trainers_seals_and_forwards_them(
    sealed_peer: tuple[_Peer, list[SealRecord]], reader: tuple[NixlAgent, MemoryRegistry]
) -> None:
    peer, seals = sealed_peer
    seeded = await _signed_seed(reader, peer.source)
    assert seeded.signed_by == JOB_KEY.fingerprint and list(seeded.seals) == seals
    assert sum(len(d) for s in seals for _, d in s.digests) > len(expected_state(REFIT))
    _bit_exact(seeded.tensors, expected_state(REFIT))
    # Another job's key (or a hostile one) does not verify those seals.
    with pytest.raises(SeedError, match="does not verify with the job's key"):
        await _signed_seed(reader, peer.source, key=RefitSigner.generate())


async def test_a_peer_without_the_trainers_seal_cannot_vouch_for_its_copy(
    peers: list[_Peer], reader: tuple[NixlAgent, MemoryRegistry]
) -> None:
    with pytest.raises(SeedError, match="a peer cannot vouch for its own copy"):
        await _signed_seed(reader, peers[1].source)


async def test_a_hostile_seeder_with_consistent_hashes_is_refused_by_the_seals(
    sealed_peer: tuple[_Peer, list[SealRecord]], reader: tuple[NixlAgent, MemoryRegistry]
) -> None:
    """Its own hashes match the bytes it offers (the check without a key passes); the
    trainer's seals do not."""
    peer, _ = sealed_peer
    name = sorted(expected_state(REFIT))[-1]
    peer.tell(f"forge {name}")
    try:
        unchecked = await _seed(reader, [peer.source], REFIT)
        assert not torch.equal(unchecked.tensors[name], expected_state(REFIT)[name])
        with pytest.raises(SeedError, match=f"tensor {name!r} bytes 0..[0-9]+ are not the ones"):
            await _signed_seed(reader, peer.source)
    finally:
        peer.tell(f"forge {name}")  # flipped back: the sealed state again
