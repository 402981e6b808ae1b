"""The one applier both shells use: a round's :class:`~refit_operator.core.decision.Decision`
turned into writes, in an order that keeps a lost status write harmless.

Order: creates first (idempotent; the status records them only once they succeeded), in
dependency waves (:func:`creation_waves`: a RoleBinding only once its Role exists, pods
only once their ServiceAccount and RoleBinding do); then what the apiserver refused is
folded into the decision (``core.write_refusals.after_writes``) and the status is written;
then deletes, rendezvous patches, gate lifts and Events.  So a lost status write can never
make a failure look like a preemption on the next round.  The status is written once per
round, and a second time only when one of the later writes was refused (the status must
then say so).

The writes themselves are the shell's (:class:`Writes`): the controller's go to the API
(``shell/kube_writes.py``), ``refit run``'s to processes and files (``local/runner.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import replace
from datetime import datetime
from typing import Any, Protocol

from refit_operator.api.models import RefitJobStatus
from refit_operator.core.coordinate import PatchData
from refit_operator.core.decision import (
    Action,
    Create,
    Decision,
    Delete,
    DeleteJob,
    Emit,
    JobView,
    LiftGate,
)
from refit_operator.core.observe import Observed
from refit_operator.core.write_refusals import after_writes
from refit_operator.core.writes import WriteError

#: Concurrent writes of one reconcile round (a 128-pod gang is created in 8 waves).
PARALLEL_CALLS = 16


class Writes(Protocol):
    """What a shell can write.  A refusal the job's status should show is returned as a
    :class:`WriteError`; anything else that goes wrong is raised."""

    async def create(self, obj: dict[str, Any]) -> WriteError | None: ...
    async def delete(self, action: Delete) -> WriteError | None: ...
    async def lift_gate(self, action: LiftGate) -> WriteError | None: ...
    async def patch_data(self, action: PatchData) -> None: ...
    async def delete_job(self) -> None: ...
    async def emit(self, event: Emit) -> None: ...
    async def write_status(self, status: RefitJobStatus) -> None: ...


class Applier:
    """Dispatches a decision's actions to a shell's :class:`Writes`."""

    def __init__(
        self,
        writes: Writes,
        *,
        clock: Callable[[], datetime],
        parallel: int = PARALLEL_CALLS,
    ) -> None:
        self._writes = writes
        self._clock = clock
        self._parallel = parallel

    async def apply(self, job: JobView, observed: Observed, decision: Decision) -> Decision:
        """Write ``decision`` (decided on ``job`` and ``observed``); returns it as written,
        with what the apiserver refused in its status."""
        refused: list[WriteError] = []
        creates = [a.obj for a in decision.actions if isinstance(a, Create)]
        for wave in creation_waves(creates):
            refused += await self._bounded([self._writes.create(obj) for obj in wave])
            if refused:
                break  # the next waves need this one (a Pod its ServiceAccount)
        decision = after_writes(job, observed, decision, refused, self._clock())
        await self._writes.write_status(decision.status)
        later = await self._after_status(decision)
        if not later:
            return decision
        # Refused deletes or gate lifts: said in the status too, then tried again.
        view = replace(job, status=decision.status)
        done = replace(decision, actions=())
        amended = after_writes(view, observed, done, later, self._clock())
        await self._writes.write_status(amended.status)
        for action in amended.actions:
            await self._write(action)
        return amended

    async def _after_status(self, decision: Decision) -> list[WriteError]:
        """Patches and Events keep their order; deletes of many pods go out together."""
        refused: list[WriteError] = []
        deletes = [a for a in decision.actions if isinstance(a, Delete)]
        for action in decision.actions:
            if isinstance(action, Create):
                continue
            if not isinstance(action, Delete):
                refused += await self._bounded([self._write(action)])
            elif action is deletes[0]:
                refused += await self._bounded([self._write(a) for a in deletes])
        return refused

    async def _write(self, action: Action) -> WriteError | None:
        writes = self._writes
        if isinstance(action, Create):
            return await writes.create(action.obj)
        if isinstance(action, Delete):
            return await writes.delete(action)
        if isinstance(action, LiftGate):
            return await writes.lift_gate(action)
        if isinstance(action, PatchData):
            await writes.patch_data(action)
        elif isinstance(action, DeleteJob):
            await writes.delete_job()
        else:
            await writes.emit(action)
        return None

    async def _bounded(
        self, calls: list[Coroutine[Any, Any, WriteError | None]]
    ) -> list[WriteError]:
        """Run writes concurrently, at most ``parallel`` at a time.  Returns the refused
        ones; re-raises any other error once every call has ended."""
        gate = asyncio.Semaphore(self._parallel)

        async def one(call: Coroutine[Any, Any, WriteError | None]) -> WriteError | None:
            async with gate:
                return await call

        results = await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)
        refused: list[WriteError] = []
        for result in results:
            if isinstance(result, BaseException):
                raise result
            if result is not None:
                refused.append(result)
        return refused


#: Kinds a create depends on, by wave: the apiserver looks each up while admitting the next.
#: A RoleBinding's escalation check reads its Role (404 while that Role is still being
#: created); a Pod's ServiceAccount admission reads its ServiceAccount.
_WAVE_OF_KIND = {"ServiceAccount": 0, "Role": 0, "RoleBinding": 1, "PodGroup": 1, "Pod": 2}
_DEFAULT_WAVE = 0


def creation_waves(objs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``objs`` grouped into waves to create one after another, in dependency order:
    ServiceAccounts, Roles, Services and ConfigMaps first, RoleBindings next, Pods last.
    Within a wave the order is kept; empty waves are left out."""
    waves: dict[int, list[dict[str, Any]]] = {}
    for obj in objs:
        waves.setdefault(_WAVE_OF_KIND.get(str(obj.get("kind")), _DEFAULT_WAVE), []).append(obj)
    return [waves[index] for index in sorted(waves)]
