"""Reassembly memory for tensors larger than a bucket, kept across refits.

A rollout rank rebuilds each tensor that spans buckets in memory of its own.  Allocating it
fresh every refit meant first-touching ~100 MiB of pages per refit, and copying every chunk
out of a bucket buffer competed with the sender's copy on a 2-core host (together ~25% of a
1 GiB refit at 64 MiB buckets, measured).  So the memory is kept per tensor name and
registered with NIXL (through the engine's
:class:`~refit_worker.engine.transport.registry.MemoryRegistry`): the receiver allocates it as soon
as the manifest names such a tensor, offers it to its senders as landing memory in its ``ready``,
and they WRITE the chunks straight into it.

A kept tensor is valid until the next refit starts (it is then overwritten); memory of names
that a refit no longer reassembles is deregistered and freed at the end of that refit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..transport.registry import MemoryRegistry


class Staging:
    """Reassembly tensors (``uint8``, one per name), kept and registered while they fit."""

    def __init__(self, registry: MemoryRegistry) -> None:
        self.registry = registry
        self._kept: dict[str, torch.Tensor] = {}

    def names(self) -> set[str]:
        return set(self._kept)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The kept tensors by name (what the receiver offers as landing memory)."""
        return dict(self._kept)

    def get(self, name: str, nbytes: int, device: torch.device) -> torch.Tensor:
        """The memory for ``name``: the kept tensor if it still fits, else a new one."""
        kept = self._kept.get(name)
        if kept is not None and kept.numel() == nbytes and kept.device == device:
            return kept
        self.drop(name)
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._kept[name] = tensor
        return tensor

    def keep_only(self, names: Iterable[str]) -> None:
        """Free the memory of every name not in ``names``."""
        for name in self.names() - set(names):
            self.drop(name)

    def drop(self, name: str) -> None:
        kept = self._kept.pop(name, None)
        if kept is not None:
            self.registry.release(kept)

    def clear(self) -> None:
        self.keep_only(())
