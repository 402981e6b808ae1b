"""A peer still listed whose process is gone: loading its metadata fails at once (UCX
connects eagerly), and the rank leaves it out instead of failing.

Real NIXL over UCX: the gone peer's agent lives in a child process that publishes its
metadata and exits; this process then loads that metadata.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from refit_worker.engine.messages.wire import NixlAgentMetadata
from refit_worker.engine.transport.agent import NixlAgent, PeerError
from refit_worker.engine.transport.peers import Peers

_CHILD = """
import sys
from refit_worker.engine.transport.agent import NixlAgent
agent = NixlAgent(name="gone-peer")
sys.stdout.write(agent.get_agent_metadata().model_dump_json())
"""


def _gone_metadata() -> NixlAgentMetadata:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, check=True
    )
    return NixlAgentMetadata.model_validate_json(out.stdout.strip().splitlines()[-1])


def test_loading_a_gone_peer_raises_peer_error_and_peers_leave_it_out() -> None:
    gone = _gone_metadata()
    agent = NixlAgent()
    with pytest.raises(PeerError, match="gone-peer"):
        agent.add_remote_agent(gone)
    # A rollout rank of (T=1, R=1) following a listing whose policy rank is gone.
    peers = Peers()
    peers.update(
        agent,
        [gone, None],
        role="rollout",
        rank=0,
        train_world_size=1,
        rollout_world_size=1,
        version=3,
        check=lambda meta, rank: None,
        forgotten=lambda name: None,
    )
    assert peers.connected == {}  # left out, not fatal
    assert peers.version == 3
