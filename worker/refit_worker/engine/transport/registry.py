"""NIXL registrations of tensor storages, made once and reused across refits.

Registering memory costs little on CPU over CMA but a lot where it pins pages (RDMA, GPU),
so a storage is registered once, keyed by its pointer, size and device, and the
registration is reused for as long as refits keep using that storage.  The registry holds
a reference to every registered storage: memory the NIC may address must not be freed and
handed to someone else under a live registration.  ``sweep`` deregisters (and lets go of)
storages that the last ``keep`` refits did not use: 1 on a sender (its weights of the last
refit), 2 on a receiver (double buffering alternates two copies).

A :class:`~refit_worker.engine.messages.wire.LandingSet` (named tensors a sender may WRITE straight
into) is built once per distinct set of tensors and carries NIXL's partial metadata of the storages
behind it, so peers connected before the memory was registered can still address it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..messages.wire import LandingRegion, LandingSet, LandingTensor
from .agent import NixlAgent

#: (storage address, storage bytes, device type, device index)
StorageKey = tuple[int, int, str, int]


def device_id(tensor: torch.Tensor) -> int:
    """NIXL's device id of a tensor's memory (the CUDA ordinal; 0 for host memory)."""
    return (tensor.device.index or 0) if tensor.device.type == "cuda" else 0


def storage_key(tensor: torch.Tensor) -> StorageKey:
    storage = tensor.untyped_storage()
    return (storage.data_ptr(), storage.nbytes(), tensor.device.type, device_id(tensor))


@dataclass
class _Registration:
    handle: Any
    keep_alive: torch.Tensor  # any tensor on the storage: it stays allocated while registered
    serial: int
    last_used: int


class MemoryRegistry:
    """Registered storages and landing sets of one agent (one engine)."""

    def __init__(self, agent: NixlAgent, mem_type: str) -> None:
        self.agent, self.mem_type = agent, mem_type
        self._storages: dict[StorageKey, _Registration] = {}
        self._sets: dict[tuple[Any, ...], tuple[LandingSet, frozenset[StorageKey]]] = {}
        self._tick = 0
        self._serial = 0
        #: Registrations made (not reused) since the registry was created, for the stats.
        self.registered = 0

    def next_refit(self) -> None:
        """Start a new refit: what it uses is marked with a new tick."""
        self._tick += 1

    def ensure(self, tensors: Iterable[torch.Tensor]) -> None:
        """Register every storage behind ``tensors`` that is not registered yet."""
        for tensor in tensors:
            key = storage_key(tensor)
            if key[1] == 0:
                continue  # nothing to address in an empty storage
            found = self._storages.get(key)
            if found is None:
                handle = self.agent.register([(key[0], key[1], key[3])], self.mem_type)
                self._serial += 1
                self.registered += 1
                found = _Registration(handle, tensor, self._serial, self._tick)
                self._storages[key] = found
            found.last_used = self._tick

    def serials(self, tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
        """Which registration each tensor's storage is under (0: none), e.g. for cache keys:
        a storage deregistered and registered again gets a new serial."""
        found = (self._storages.get(storage_key(t)) for t in tensors)
        return tuple(reg.serial if reg is not None else 0 for reg in found)

    def landing_set(self, named: Mapping[str, torch.Tensor]) -> LandingSet:
        """The landing set for ``named`` (contiguous tensors), registering what it needs."""
        tensors = {name: t for name, t in named.items() if t.numel()}
        self.ensure(tensors.values())
        keys = frozenset(storage_key(t) for t in tensors.values())
        ident = (
            tuple(
                (name, t.data_ptr(), t.numel() * t.element_size(), device_id(t))
                for name, t in tensors.items()
            ),
            tuple(sorted((key, self._storages[key].serial) for key in keys)),
        )
        cached = self._sets.get(ident)
        if cached is None:
            regions = [(key[0], key[1], key[3]) for key in sorted(keys)]
            metadata = self.agent.regions_metadata(regions, self.mem_type) if regions else b""
            digest = hashlib.sha256(repr(ident).encode()).hexdigest()[:24]
            landing = LandingSet(
                id=f"{self.agent.name}:{digest}",
                metadata=metadata,
                tensors=tuple(
                    LandingTensor(name=name, nbytes=nbytes, addr=addr, dev_id=dev)
                    for name, addr, nbytes, dev in ident[0]
                ),
                regions=tuple(
                    LandingRegion(addr=key[0], nbytes=key[1], dev_id=key[3], registration=serial)
                    for key, serial in ident[1]
                ),
            )
            cached = (landing, keys)
            self._sets[ident] = cached
        return cached[0]

    def sweep(self, keep: int) -> None:
        """Deregister storages (and forget landing sets) the last ``keep`` refits did not use."""
        oldest = self._tick - keep + 1
        stale = {k for k, reg in self._storages.items() if reg.last_used < oldest}
        for key in stale:
            self.agent.deregister(self._storages.pop(key).handle)
        for ident in [i for i, (_, keys) in self._sets.items() if keys & stale]:
            del self._sets[ident]

    def release(self, tensor: torch.Tensor) -> None:
        """Deregister the storage behind ``tensor`` now (its memory is about to be freed)."""
        key = storage_key(tensor)
        found = self._storages.pop(key, None)
        if found is not None:
            self.agent.deregister(found.handle)
            for ident in [i for i, (_, keys) in self._sets.items() if key in keys]:
                del self._sets[ident]

    def clear(self) -> None:
        """Deregister everything (``finalize``, or memory about to be freed)."""
        for reg in self._storages.values():
            self.agent.deregister(reg.handle)
        self._storages.clear()
        self._sets.clear()

    def __len__(self) -> int:
        return len(self._storages)


__all__ = ["MemoryRegistry", "StorageKey", "device_id", "storage_key"]
