"""A seed peer that leaves between its manifest and the READ (a drained pod that stopped
staying, seen in a full run beside a busy core: NIXL_ERR_REMOTE_DISCONNECT when its
region's metadata was loaded) fails the seed try, a :class:`SeedError` the caller falls
back from; before, the :class:`PeerError` escaped and failed the rank's pod (exit 1).

Stand-in: the NIXL agent, which raises as the real one did; the READ over real NIXL is in
``tests/e2e/test_peer_seeding.py``."""

from __future__ import annotations

import pytest
import torch

from refit_worker.engine.messages.wire import (
    LandingSet,
    LandingTensor,
    NixlAgentMetadata,
)
from refit_worker.engine.rollout.seed_transfer import SeedError, SeedSource, _read_share, _Reader
from refit_worker.engine.transport.agent import PeerError


class _GoneAgent:
    def __init__(self, fails: str) -> None:
        self.fails = fails
        self.reads = 0

    def add_remote_memory(self, peer: str, metadata: bytes) -> None:
        if self.fails == "metadata":
            raise PeerError(f"bad memory metadata from {peer!r}: NIXL_ERR_REMOTE_DISCONNECT")

    async def read(self, peer: str, *args: object, **kw: object) -> None:
        self.reads += 1
        raise PeerError(f"READ from {peer!r} went to ERR")


class _Registry:
    mem_type = "DRAM"

    def ensure(self, tensors: object) -> None:
        list(tensors)  # type: ignore[call-overload]


@pytest.mark.parametrize("fails", ["metadata", "read"])
async def test_a_peer_gone_mid_seed_is_a_failed_try_not_a_failed_pod(fails: str) -> None:
    target = torch.zeros(8, dtype=torch.bfloat16)
    agent = _GoneAgent(fails)
    reader = _Reader(agent, _Registry(), torch.device("cpu"))  # type: ignore[arg-type]
    source = SeedSource(
        "rollout-1-g4",
        NixlAgentMetadata(agent_name="refit-gone", agent_metadata=b"x"),
        (4096, 16, 0),
        b"region",
    )
    landing = LandingSet(
        id="l", metadata=b"meta", tensors=(LandingTensor(name="w", nbytes=16, addr=4096),)
    )
    with pytest.raises(SeedError, match=r"rollout-1-g4: .*(REMOTE_DISCONNECT|went to ERR)"):
        await _read_share(reader, source, landing, ["w"], targets={"w": target}, deadline=1e12)
    assert agent.reads == (0 if fails == "metadata" else 1)
