"""Rendezvous of policy and rollout ranks: where they publish NIXL agent metadata, wait to
be members of the epoch, report progress and hear of a preemption.

The protocol itself (keys, entries, shard layout, coordinator decisions) is pure and lives
in the contract, :mod:`refit_worker.contract.rendezvous`; here is the I/O.  :mod:`.store`
is the interface with the worker's and coordinator's operations, which :mod:`.file_store`
and :mod:`.configmap_store` implement (:func:`open_store` picks one from the worker
config); :mod:`.watch` watches for the preemption notice in the background.
"""

from __future__ import annotations

from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.rendezvous import Layout
from refit_worker.contract.waits import CancelFlag, WaitCancelled
from refit_worker.rendezvous.configmap_store import ConfigMapStore
from refit_worker.rendezvous.file_store import FileStore
from refit_worker.rendezvous.store import (
    Member,
    Preempted,
    Removed,
    RendezvousError,
    RendezvousStore,
    RendezvousTimeout,
)
from refit_worker.rendezvous.watch import PreemptionWatch

__all__ = [
    "CancelFlag",
    "ConfigMapStore",
    "FileStore",
    "Member",
    "Preempted",
    "PreemptionWatch",
    "Removed",
    "RendezvousError",
    "RendezvousStore",
    "RendezvousTimeout",
    "WaitCancelled",
    "open_store",
]


def open_store(config: WorkerConfig) -> RendezvousStore:
    """The store ``config.rendezvous`` names: the job's ConfigMaps, or a local directory."""
    layout = Layout.from_config(config)
    if config.rendezvous.store == "file":
        return FileStore(config.rendezvous.location, layout)
    return ConfigMapStore(config.rendezvous.location, config.namespace, layout)
