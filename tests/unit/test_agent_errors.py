"""NIXL raises its own error types (``nixlRemoteDisconnectError``...) when a peer dies in
the middle of a transfer, where a state of "ERR" was expected: the agent turns both into
``PeerError`` naming the peer, so the rank reports a peer failure, not a raw nixl type.

Emulated: the nixl agent object (a stub that raises as nixl does on a dead peer), because
a real peer's death cannot be timed to land inside one call; tests/e2e/test_nixl_failures.py
kills a real peer with SIGKILL.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from refit_worker.engine.transport.agent import NixlAgent, PeerError


class nixlRemoteDisconnectError(RuntimeError):  # named as nixl names it
    pass


class _DeadPeer:
    def check_xfer_state(self, handle: Any) -> str:
        raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")

    def transfer(self, handle: Any, notif: bytes = b"") -> str:
        raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")

    def send_notif(self, peer: str, message: bytes) -> None:
        raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")


def _agent() -> NixlAgent:
    agent = object.__new__(NixlAgent)
    agent._agent = _DeadPeer()
    return agent


def test_a_wait_on_a_transfer_to_a_dead_peer_raises_peer_error_naming_it() -> None:
    with pytest.raises(PeerError, match=r"bucket 3 to 'rollout-0'.*RemoteDisconnect") as info:
        asyncio.run(_agent().wait_posted(object(), "rollout-0", "bucket 3", time.monotonic() + 5))
    assert isinstance(info.value.__cause__, nixlRemoteDisconnectError)


def test_posting_to_a_dead_peer_raises_peer_error_naming_it() -> None:
    with pytest.raises(PeerError, match=r"WRITE to 'rollout-1' failed.*RemoteDisconnect"):
        _agent().post_prepared(object(), "rollout-1", b"n")
