"""Rendezvous of policy and rollout ranks: where they publish NIXL agent metadata, wait for
the barrier, report progress and hear of a job-wide preemption.

:mod:`.protocol` is pure (keys, entries, shard assignment, coordinator decisions);
:mod:`.store` is the interface with the worker's and coordinator's operations;
:mod:`.file_store` and :mod:`.configmap_store` implement it.  :func:`open_store` picks one
from the worker config.

Must not import: the operator; torch or nixl (the payload is opaque JSON text).
"""

from __future__ import annotations
