"""Which local port each rank serves its metrics on, when the job sets ``metrics.port``.

On a cluster every pod has its own network namespace, so every rank serves on the same
``metrics.port``.  On one machine they would all bind one port and every rank but the
first would only log "cannot serve metrics".  So each rank gets a port of its own,
counted up from ``metrics.port`` (skipping ports in use), fixed before anything starts so
that ``refit run`` can say where each serves and a restarted rank serves where it did.

Pure apart from the ``is_free`` probe the caller passes.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from typing import Any

from refit_operator.api import names
from refit_operator.api.models import RefitJobSpec

#: (role, rank) -> port.
Plan = dict[tuple[str, int], int]
HIGHEST_PORT = 65535


class PortsError(ValueError):
    """Not enough free ports above ``metrics.port`` for every rank."""


def plan(spec: RefitJobSpec, is_free: Callable[[int], bool]) -> Plan:
    """A free port per rank, policy ranks first, counted up from ``metrics.port``."""
    if spec.metrics is None:
        return {}
    ranks = [("policy", r) for r in range(spec.policy.replicas)]
    ranks += [("rollout", r) for r in range(spec.rollout.replicas)]
    ports: Plan = {}
    port = spec.metrics.port
    for key in ranks:
        while port <= HIGHEST_PORT and (port == names.MASTER_PORT or not is_free(port)):
            port += 1
        if port > HIGHEST_PORT:
            raise PortsError(
                f"metrics.port {spec.metrics.port}: not enough free ports above it for "
                f"{len(ranks)} ranks; choose a lower metrics.port"
            )
        ports[key] = port
        port += 1
    return ports


def port_of(ports: Mapping[tuple[str, int], int], pod: Mapping[str, Any]) -> int | None:
    """The port planned for a rendered pod (None: no plan for it)."""
    labels = pod["metadata"].get("labels") or {}
    role, rank = labels.get(names.LABEL_ROLE), labels.get(names.LABEL_RANK)
    if role is None or rank is None or not str(rank).isdigit():
        return None
    return ports.get((str(role), int(rank)))


def describe(job: str, ports: Mapping[tuple[str, int], int]) -> str:
    """One line: where each rank serves."""
    shown = ", ".join(
        f"{job}-{role}-{rank} :{port}"  # a rank, whichever pod (incarnation) runs it
        for (role, rank), port in ports.items()
    )
    return f"refit run: metrics at http://127.0.0.1:PORT/metrics, per rank: {shown}"


def loopback_free(port: int) -> bool:
    """Whether nothing listens on ``port`` of 127.0.0.1 (binding it is the test)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
