"""Shared by the integration and reliability tiers and bench/: the sample job, waiting with
a deadline, kubelet-like status writes, and an operator run that can be stopped and
started again (against the API emulator).
"""

from __future__ import annotations

import asyncio
import contextvars
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from tests.emulator import ApiEmulator

DATA = Path(__file__).resolve().parents[1] / "data"
JOBS = "refit.dev/v1alpha1/refitjobs"
PODS = "v1/pods"
NS = "default"


def load_job(name: str = "demo", **spec_changes: Any) -> dict[str, Any]:
    """The checked-in minimal RefitJob, renamed and with top-level spec keys replaced."""
    job: dict[str, Any] = yaml.safe_load((DATA / "refitjob.yaml").read_text())
    job["metadata"]["name"] = name
    job["spec"].update(spec_changes)
    return job


async def eventually(
    check: Callable[[], Any], what: str, timeout: float = 60.0, interval: float = 0.05
) -> Any:
    """Wait until ``check()`` returns something truthy; fail naming ``what`` on timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = interval
    while True:
        value = check()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)  # bounded back-off, not a busy loop


def set_pod_phase(api: ApiEmulator, name: str, phase: str, **extra: Any) -> None:
    """Do what a kubelet would: write the pod's status."""
    ready = "True" if phase == "Running" else "False"
    status: dict[str, Any] = {"phase": phase, "conditions": [{"type": "Ready", "status": ready}]}
    status.update(extra)
    api.patch(PODS, NS, name, {"status": status}, status=True)


_IN_OPERATOR: contextvars.ContextVar[bool] = contextvars.ContextVar("in_operator", default=False)


class _ForeignTasks:
    """Tasks kopf must leave alone when it stops: all but those the operator spawned.

    kopf cancels every task that appeared after it started (pytest's fixture teardown and
    the emulator's request handlers included); a task factory marks the operator's own.
    """

    def __init__(self) -> None:
        self.ours: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()

    def __contains__(self, task: object) -> bool:
        return task not in self.ours

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
            task = asyncio.Task(coro, loop=loop, **kwargs)
            if _IN_OPERATOR.get():
                self.ours.add(task)
            return task

        loop.set_task_factory(factory)


class OperatorRun:
    """The operator embedded in the test's loop; it can be stopped and started again."""

    def __init__(self, **config: Any) -> None:
        self.config = config
        self._task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None

    async def start(self) -> None:
        import kopf

        from refit_operator.shell.handlers import operator_kwargs
        from refit_operator.shell.settings import OperatorConfig

        loop = asyncio.get_running_loop()
        foreign = _ForeignTasks()
        foreign.install(loop)
        self._stop, ready = asyncio.Event(), asyncio.Event()
        kwargs = operator_kwargs(OperatorConfig(namespaces=(NS,), **self.config))

        async def main() -> None:
            tasks = await kopf.spawn_tasks(**kwargs, stop_flag=self._stop, ready_flag=ready)
            await kopf.run_tasks(tasks, ignored=foreign)

        token = _IN_OPERATOR.set(True)
        try:
            self._task = loop.create_task(main())
        finally:
            _IN_OPERATOR.reset(token)
        await asyncio.wait_for(ready.wait(), timeout=30)

    async def stop(self) -> None:
        """Stop and wait; fails when the operator does not stop within 30 s."""
        if self._task is None or self._stop is None:
            return
        self._stop.set()
        try:
            await asyncio.wait_for(self._task, timeout=30)
        finally:
            self._task = None
            asyncio.get_running_loop().set_task_factory(None)
