"""kube-refit worker library: what runs inside policy and rollout pods.

The session (``from refit_worker import RefitSession``) is the entry point for users' own
trainer and server code.  A session is built from the same ``REFIT_*`` environment the operator
renders (:meth:`RefitSession.from_env`), and is of the rank's role: a :class:`PolicySession` or
a :class:`RolloutSession` (``PolicySession.from_env()`` / ``RolloutSession.from_env()`` say
which one the caller expects, and refuse the other).  Both are built on one
:class:`~refit_worker.session.connection.Connection`, which owns the NIXL checkpoint engine and
the rendezvous: :meth:`~RefitSession.connect` publishes this rank's agent metadata, waits for
its place in the membership (the barrier) and connects to the peers; then a policy rank calls
:meth:`PolicySession.send` with its ``named_parameters()`` for each refit (to the rollout
members of the moment; :meth:`PolicySession.linger` after the last one serves members that
joined late), and a rollout rank receives each refit straight into final, registered tensors
(no clone), verifies it (manifest completeness and integrity hashes in the engine, plus an
optional caller check) and only then commits it:

* :meth:`RolloutSession.receive_into` ``(model, mode="double_buffer")``: into a spare
  copy of the model's tensors, committed by swapping it with the served one; readers
  never see a partial refit;
* ``receive_into(model, mode="in_place")``: straight into the live parameters while
  the server has paused generation; a refit that stops part-way raises
  :class:`PartialRefitError` (or :class:`Preempted` with ``weights_partial``): the live
  weights are then partial and must not be served until a later refit completes;
* :meth:`RolloutSession.receive`: double-buffered into the session's own state,
  :attr:`RolloutSession.committed`.

:class:`RefitStats` times only the transfer and the commit: from the moment the transfer
could start (landing memory ready, senders told) to the commit, leaving out waiting for the
peer, weight generation, the caller's ``verify`` and control work (``control_seconds``).

Every transfer runs beside a watcher that stops it at the next bucket boundary when this
process got the preemption signal or the job posted a preemption notice for its role; the
call then raises :class:`Preempted`.  The watcher also follows the membership: a policy
rank drops targets that left; a rollout rank abandons a refit when the policy epoch moves
on and takes the next one from the new policy gang, without a restart.  A rollout rank
removed by a scale-down gets :class:`Removed` (report ``left``, exit 0); one whose rank
another pod holds now gets :class:`Superseded` (exit as preempted, report nothing).

Where things live: ``policy/`` (the policy rank's session: what each member is owed, the
gang's one plan, the delta source), ``rollout/`` (the rollout rank's session: targets, the
delta base, peer seeds and the seed choice), ``session/`` (what both roles share: the
connection, following the membership, refit results, progress reports), ``engine/``... see
``docs/architecture.md``.  ``contract/`` is what the operator and the worker agree on
(start reading there).

The names below load on first use: importing this package imports none of the heavy
modules (torch, nixl, kubernetes), so the preStop delivery command stays dependency-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from refit_worker.policy.policy_session import PolicySession
    from refit_worker.rendezvous import Preempted
    from refit_worker.rollout.rollout_session import RolloutSession
    from refit_worker.rollout.targets import PartialRefitError
    from refit_worker.session.refit_session import RefitSession
    from refit_worker.session.refits import (
        CommittedRefit,
        DeltaChanges,
        RefitStats,
        RefitUndelivered,
        Removed,
        StateDict,
        Superseded,
        Verifier,
    )

__version__ = "0.1.0"

# Public name -> the module that defines it.
_HOMES = {
    "CommittedRefit": "refit_worker.session.refits",
    "DeltaChanges": "refit_worker.session.refits",
    "PartialRefitError": "refit_worker.rollout.targets",
    "PolicySession": "refit_worker.policy.policy_session",
    "Preempted": "refit_worker.rendezvous",
    "RefitSession": "refit_worker.session.refit_session",
    "RefitStats": "refit_worker.session.refits",
    "RefitUndelivered": "refit_worker.session.refits",
    "Removed": "refit_worker.session.refits",
    "RolloutSession": "refit_worker.rollout.rollout_session",
    "StateDict": "refit_worker.session.refits",
    "Superseded": "refit_worker.session.refits",
    "Verifier": "refit_worker.session.refits",
}

__all__ = [
    "CommittedRefit",
    "DeltaChanges",
    "PartialRefitError",
    "PolicySession",
    "Preempted",
    "RefitSession",
    "RefitStats",
    "RefitUndelivered",
    "Removed",
    "RolloutSession",
    "StateDict",
    "Superseded",
    "Verifier",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'refit_worker' has no attribute {name!r}")
    if name == "RefitSession":
        # RefitSession(config) dispatches to the role's class, which registers on import.
        importlib.import_module("refit_worker.policy.policy_session")
        importlib.import_module("refit_worker.rollout.rollout_session")
    return getattr(importlib.import_module(home), name)
