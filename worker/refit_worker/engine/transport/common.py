"""What both roles of the engine use: :class:`EngineCommon`.

The settings a refit runs with (bucket size, device, timeout, integrity, striping), the NIXL
agent and its memory registry once ``prepare()`` made them, the hash pool, the peers of the
other role (:class:`~.peers.Peers`) and the refit-id counter.  The per-role parts
(:mod:`refit_worker.engine.policy.policy_side`,
:mod:`refit_worker.engine.rollout.rollout_side`) hold one each and keep only their own state.
"""

from __future__ import annotations

from typing import Any

import torch

from ..messages.integrity import Hasher
from ..messages.signing import RefitSigner, RefitVerifier
from .agent import NixlAgent, take_preinit_agent
from .peers import Peers
from .registry import MemoryRegistry


class EngineCommon:
    """Settings and resources of one engine, whatever its role (see the module docstring)."""

    def __init__(
        self,
        *,
        bucket_size: int,
        device: torch.device,
        timeout_s: float,
        checksum: bool,
        stripe: bool,
        hash_threads: int | None,
        signer: RefitSigner | None = None,
        verifier: RefitVerifier | None = None,
    ) -> None:
        self.bucket_size, self.device = bucket_size, device
        #: The job's key halves: a policy rank seals what it sends, a rollout rank takes
        #: only sealed refits (:mod:`refit_worker.engine.messages.signing`); None: unsigned,
        #: unchecked.
        self.signer, self.verifier = signer, verifier
        self.timeout_s, self.checksum, self.stripe = timeout_s, checksum, stripe
        self.hash_threads = hash_threads
        #: The id of the next refit (see :meth:`next_refit`).
        self.refit_id = 0
        self.peers = Peers()  # of the other role, following the membership (update_peers)
        #: The agent once :meth:`start` made it (None before, and None-safe teardown).
        self.nixl_agent: NixlAgent | None = None
        self.memory: MemoryRegistry | None = None
        self.hasher: Hasher | None = None

    @property
    def mem_type(self) -> str:
        return "VRAM" if self.device.type == "cuda" else "DRAM"

    def start(self, backend_name: str, backend_init_params: dict[str, Any] | None) -> None:
        """Create the agent and its registry, each once (a pre-initialised agent first)."""
        if self.nixl_agent is None:
            self.nixl_agent = take_preinit_agent(backend_name, backend_init_params) or (
                NixlAgent(backend_name, backend_init_params)
            )
        if self.memory is None:
            self.memory = MemoryRegistry(self.agent, self.mem_type)

    @property
    def agent(self) -> NixlAgent:
        if self.nixl_agent is None:
            raise RuntimeError("call prepare() first: the engine has no NIXL agent yet")
        return self.nixl_agent

    @property
    def registry(self) -> MemoryRegistry:
        if self.memory is None:
            raise RuntimeError("call prepare() first: the engine has no NIXL agent yet")
        return self.memory

    def hash_pool(self) -> Hasher:
        """The hash pool, started on first use (only refits with integrity need it)."""
        if self.hasher is None:
            self.hasher = Hasher(self.hash_threads)
        return self.hasher

    def next_refit(self, refit_id: int | None) -> int:
        """The id of this refit (``refit_id`` if given, else the counter's); moves it on."""
        if refit_id is not None:
            if isinstance(refit_id, bool) or not isinstance(refit_id, int) or refit_id < 0:
                raise ValueError(f"refit_id must be an int >= 0, got {refit_id!r}")
            self.refit_id = refit_id
        current = self.refit_id
        self.refit_id += 1
        return current

    def close(self) -> None:
        """Stop the hash pool (a later refit with integrity starts a new one)."""
        if self.hasher is not None:
            self.hasher.close()
            self.hasher = None


__all__ = ["EngineCommon"]
