"""The doing half of the operator: read a job and its children, call the pure reconcile,
apply its actions through the one applier (``apply/applier.py``, with the API writes of
``kube_writes.py``).  One coalescing loop per job serialises the work, retries a round
the apiserver refused with back-off, and says so in an Event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from refit_operator.api import names
from refit_operator.api.models import API_VERSION, KIND, RefitJobStatus, parse_status
from refit_operator.apply.applier import Applier
from refit_operator.core.backoff import doubling
from refit_operator.core.decision import JobView
from refit_operator.core.nodes import NodeFacts, gone_node, node_facts
from refit_operator.core.observe import Observed, observe
from refit_operator.core.reconcile import reconcile
from refit_operator.render.pods import JobRef, RenderOptions
from refit_operator.shell import kube
from refit_operator.shell.kube_writes import KubeWrites
from refit_operator.shell.metrics import OperatorMetrics

log = logging.getLogger(__name__)

#: Immediate re-runs after a 409 on the status write, before giving up for this trigger.
CONFLICT_RETRIES = 5
RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0


@dataclass
class _JobLoop:
    running: bool = False
    dirty: bool = False
    timer: asyncio.TimerHandle | None = None
    due: float = float("inf")
    failures: int = 0
    #: The last API error a failed round met, already announced in an Event.
    announced: str = ""
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


class Controller:
    """Per-process reconcile driver for RefitJobs."""

    def __init__(
        self,
        api: kube.Kube,
        options: RenderOptions,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        metrics: OperatorMetrics | None = None,
        guard: Callable[[], None] = lambda: None,
    ) -> None:
        self._api = api
        self._options = options
        self._clock = clock
        self._jobs: dict[tuple[str, str], _JobLoop] = {}
        self.reconciles = 0
        self.metrics = metrics
        #: Called before every round; raises (or ends the process) when this replica must
        #: not reconcile any more (a lost leader Lease).
        self._guard = guard
        self._warned_nodes = False

    async def close(self) -> None:
        for key in list(self._jobs):
            self.forget(*key)
        await self._api.close()

    def forget(self, namespace: str, name: str) -> None:
        loop = self._jobs.pop((namespace, name), None)
        if loop is not None:
            if loop.timer is not None:
                loop.timer.cancel()
            for task in loop.tasks:
                task.cancel()

    async def reconcile(self, namespace: str, name: str) -> None:
        """Reconcile now, or make the running round go again; raises what the run raised.

        A round the apiserver refuses (a list, the status write) is retried here with
        back-off and announced in an Event, whoever called: a caller that gives up on the
        error (kopf's permanent failure) does not stop the job's retries."""
        state = self._jobs.setdefault((namespace, name), _JobLoop())
        state.dirty = True
        if state.running:
            return  # the running loop sees `dirty` and goes once more
        state.running = True
        try:
            conflicts = 0
            while state.dirty:
                state.dirty = False
                try:
                    requeue = await self._timed(namespace, name)
                except kube.ConflictError:
                    conflicts += 1
                    if conflicts > CONFLICT_RETRIES:
                        raise
                    state.dirty = True
                    await asyncio.sleep(RETRY_MIN_S * conflicts)  # bounded back-off
                    continue
                if requeue is not None:
                    self._schedule(namespace, name, state, requeue)
            state.failures, state.announced = 0, ""
        except kube.ApiError as exc:
            if not isinstance(exc, kube.ConflictError):
                await self._retry_later(namespace, name, state, exc)
            raise
        finally:
            state.running = False

    async def nudge(self, namespace: str, name: str) -> None:
        """Reconcile after a child changed; errors are logged and retried with back-off."""
        try:
            await self.reconcile(namespace, name)
        except kube.ApiError as exc:
            if isinstance(exc, kube.ConflictError):
                state = self._jobs.setdefault((namespace, name), _JobLoop())
                await self._retry_later(namespace, name, state, exc)
            # any other: reconcile() announced it and set the retry
        except Exception as exc:  # any failure: keep the job alive with a later retry
            state = self._jobs.setdefault((namespace, name), _JobLoop())
            await self._retry_later(namespace, name, state, exc)

    async def _retry_later(
        self, namespace: str, name: str, state: _JobLoop, exc: Exception
    ) -> None:
        state.failures += 1
        delay = doubling(RETRY_MIN_S * 2, RETRY_MAX_S, state.failures)
        log.warning("reconcile of %s/%s failed (%s); retry in %.1fs", namespace, name, exc, delay)
        if isinstance(exc, kube.ApiError) and not isinstance(exc, kube.ConflictError):
            await self._announce(namespace, name, state, exc)
        self._schedule(namespace, name, state, delay)

    async def _announce(
        self, namespace: str, name: str, state: _JobLoop, exc: kube.ApiError
    ) -> None:
        """A round the apiserver stopped (a list or the status write refused) is said in a
        Warning Event too, once per distinct error, not only in the operator's log."""
        text = f"reconcile failed, retrying with back-off: {exc}"
        if text == state.announced:
            return
        try:
            job = await self._api.get(API_VERSION, KIND, namespace, name)
            if job is not None:
                await self._api.post_event(job, "Warning", "ReconcileFailed", text)
                state.announced = text
        except Exception as failed:  # an Event is a courtesy; the retry goes on regardless
            log.warning("could not post the ReconcileFailed event: %s", failed)

    def _schedule(self, namespace: str, name: str, state: _JobLoop, delay: float) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        if state.timer is not None and state.due <= due:
            return  # an earlier wake-up is already set
        if state.timer is not None:
            state.timer.cancel()

        def fire() -> None:
            state.timer, state.due = None, float("inf")
            task = loop.create_task(self.nudge(namespace, name))
            state.tasks.add(task)
            task.add_done_callback(state.tasks.discard)

        state.timer, state.due = loop.call_later(delay, fire), due

    async def resync(self, namespaces: Iterable[str | None], *, nudge: bool = True) -> int:
        """List the RefitJobs of ``namespaces`` (None: all) and, with ``nudge``, reconcile
        each, whatever the events said; returns how many were listed.  Raises when a list
        fails."""
        listed = [
            (job["metadata"]["namespace"], job["metadata"]["name"])
            for namespace in namespaces
            for job in await self._api.list(API_VERSION, KIND, namespace, {})
        ]
        for namespace, name in listed if nudge else ():
            state = self._jobs.setdefault((namespace, name), _JobLoop())
            self._schedule(namespace, name, state, 0.0)
        return len(listed)

    async def _timed(self, namespace: str, name: str) -> float | None:
        started = time.perf_counter()
        try:
            return await self._reconcile_round(namespace, name)
        except Exception:
            if self.metrics is not None:
                self.metrics.reconcile_errors.inc()
            raise
        finally:
            if self.metrics is not None:
                self.metrics.reconcile_seconds.observe(time.perf_counter() - started)

    async def delete_pods(self, namespace: str, name: str) -> None:
        """Stop the gang at once when its job goes; the rest goes by ownerReference."""
        self.forget(namespace, name)
        if self.metrics is not None:
            self.metrics.job_gone(namespace, name)
        for pod in await self._api.list("v1", "Pod", namespace, {names.LABEL_JOB: name}):
            await self._api.delete("v1", "Pod", namespace, pod["metadata"]["name"])

    async def _reconcile_round(self, namespace: str, name: str) -> float | None:
        """Read the job and its children, decide, apply; returns when to look again."""
        self._guard()
        job = await self._api.get(API_VERSION, KIND, namespace, name)
        if job is None or job["metadata"].get("deletionTimestamp"):
            if self.metrics is not None:
                self.metrics.job_gone(namespace, name)
            return None
        self.reconciles += 1
        view, observed = await self._observe(job)
        decision = reconcile(view, observed, self._clock(), self._options)
        if decision.hands_off:
            return None  # another controller's job (spec.managedBy): not even its status

        def on_status(status: RefitJobStatus) -> None:
            if self.metrics is not None:
                self.metrics.job_round(namespace, name, status, observed.entries)

        writes = KubeWrites(self._api, job, on_status=on_status)
        applier = Applier(writes, clock=self._clock)
        return (await applier.apply(view, observed, decision)).requeue_after

    async def _observe(self, job: dict[str, Any]) -> tuple[JobView, Observed]:
        """The job as the reconcile reads it, and the children this very job owns."""
        meta = job["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        uid = str(meta.get("uid", ""))
        selector = {names.LABEL_JOB: name}
        pods = _owned(await self._api.list("v1", "Pod", namespace, selector), uid)
        others: list[dict[str, Any]] = []
        for api_version, kind in kube.STATIC_KINDS:
            others += _owned(await self._api.list(api_version, kind, namespace, selector), uid)
        rendezvous = {
            o["metadata"]["name"]: dict(o.get("data") or {})
            for o in others
            if o["kind"] == "ConfigMap"
        }
        view = JobView(
            ref=JobRef(
                name=name,
                namespace=namespace,
                uid=uid,
                pod_labels=names.propagated_labels(meta.get("labels") or {}),
            ),
            generation=int(meta.get("generation", 1)),
            raw_spec=job.get("spec"),
            status=parse_status(job.get("status")),
        )
        nodes = await self.read_nodes(pods)
        bound = view.basics.node_lost_seconds  # read through the models, valid or not
        return view, observe(
            pods, others, rendezvous, nodes=nodes, now=self._clock(), node_lost_seconds=bound
        )

    async def read_nodes(self, pods: list[dict[str, Any]]) -> dict[str, NodeFacts]:
        """The facts of each node a pod of the job is bound to, read concurrently (a GET
        per node, not a list of the whole cluster's).  Without the right to read Nodes
        (a chart older than the operator) the round goes on without them, said once."""
        wanted = sorted(
            {str(p["spec"]["nodeName"]) for p in pods if (p.get("spec") or {}).get("nodeName")}
        )
        try:
            found = await asyncio.gather(*(self._api.get_node(n) for n in wanted))
        except kube.ApiError as exc:
            if exc.status != 403:
                raise
            if not self._warned_nodes:
                log.warning("cannot read Nodes, pods on lost nodes go unnoticed: %s", exc)
                self._warned_nodes = True
            return {}
        return {
            n: gone_node(n) if node is None else node_facts(node)
            for n, node in zip(wanted, found, strict=True)
        }


def _owned(objs: list[dict[str, Any]], uid: str) -> list[dict[str, Any]]:
    """Only children this very job controls (a same-named predecessor's are not ours)."""
    return [
        o
        for o in objs
        if any(
            ref.get("uid") == uid and ref.get("controller")
            for ref in o["metadata"].get("ownerReferences") or []
        )
    ]
