"""Reassembly memory for tensors larger than a bucket, kept across refits.

A rollout rank rebuilds each tensor that spans buckets in memory of its own.  Allocating it
fresh every refit meant first-touching ~100 MiB of pages per refit, and copying every chunk
out of a bucket buffer competed with the sender's copy on a 2-core host (together ~25% of a
1 GiB refit at 64 MiB buckets, measured).  So the memory is kept per tensor name and
registered with NIXL: from the second refit on, the receiver offers it to its senders as
``landing`` in their first credit and they WRITE the chunks straight into it.

A kept tensor is valid until the next refit starts (it is then overwritten); memory of names
that a refit no longer reassembles is deregistered and freed at the end of that refit.

Must not import: torch.distributed, the engine module (``nixl.py``), the operator.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .agent import NixlAgent
from .messages import Landing


class Staging:
    """Registered reassembly tensors (``uint8``, one per name), reused while they fit."""

    def __init__(self, agent: NixlAgent, mem_type: str) -> None:
        self.agent, self.mem_type = agent, mem_type
        self._kept: dict[str, tuple[torch.Tensor, Any, bytes]] = {}

    def names(self) -> set[str]:
        return set(self._kept)

    def offers(self) -> tuple[Landing, ...]:
        """Landing memory for every kept tensor, as plain data for a credit message."""
        return tuple(
            Landing(
                name=name,
                nbytes=t.numel(),
                addr=t.data_ptr(),
                dev_id=t.device.index or 0,
                metadata=metadata,
            )
            for name, (t, _, metadata) in self._kept.items()
        )

    def get(self, name: str, nbytes: int, device: torch.device) -> torch.Tensor:
        """The memory for ``name``: the kept tensor if it still fits, else a new one."""
        kept = self._kept.get(name)
        if kept is not None and kept[0].numel() == nbytes and kept[0].device == device:
            return kept[0]
        self.drop(name)
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        handle = self.agent.register(
            [(tensor.data_ptr(), nbytes, tensor.device.index or 0)], self.mem_type
        )
        self._kept[name] = (tensor, handle, self.agent.memory_metadata(handle))
        return tensor

    def keep_only(self, names: Iterable[str]) -> None:
        """Free the memory of every name not in ``names``."""
        for name in self.names() - set(names):
            self.drop(name)

    def drop(self, name: str) -> None:
        kept = self._kept.pop(name, None)
        if kept is not None:
            self.agent.deregister(kept[1])

    def clear(self) -> None:
        self.keep_only(())
