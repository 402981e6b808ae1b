"""The doing half of the operator: read a job and its children, call the pure reconcile,
apply its actions, write the status.  One coalescing loop per job serialises the work.

Order of effects: creates go first (they are idempotent, and the status records them only
once they succeeded), in dependency waves (:func:`creation_waves`: a RoleBinding only once
its Role exists, pods only once their ServiceAccount and RoleBinding do); then the status
is written, conditional on the resourceVersion read; then deletes, rendezvous clearing and
Events.  So a lost status write can never make a failure look like a preemption on the
next round.

Must not import: kopf (the handlers wrap this; a local runner could drive it too).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from refit_operator import kube, names, reconcile
from refit_operator.coordinate import PatchData
from refit_operator.decision import Action, Decision
from refit_operator.metrics import OperatorMetrics
from refit_operator.models import API_VERSION, KIND, parse_status
from refit_operator.observe import observe
from refit_operator.render import JobRef, RenderOptions
from refit_operator.writes import WriteError

log = logging.getLogger(__name__)

#: Immediate re-runs after a 409 on the status write, before giving up for this trigger.
CONFLICT_RETRIES = 5
RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0
#: Concurrent writes of one reconcile round (a 128-pod gang is created in 8 waves).
PARALLEL_CALLS = 16


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
        delay = min(RETRY_MAX_S, RETRY_MIN_S * 2**state.failures)
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
            return await self._once(namespace, name)
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

    async def _once(self, namespace: str, name: str) -> float | None:
        self._guard()
        job = await self._api.get(API_VERSION, KIND, namespace, name)
        if job is None or job["metadata"].get("deletionTimestamp"):
            if self.metrics is not None:
                self.metrics.job_gone(namespace, name)
            return None
        self.reconciles += 1
        meta = job["metadata"]
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
        view = reconcile.JobView(
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
        observed = observe(pods, others, rendezvous)
        decision = reconcile.reconcile(view, observed, self._clock(), self._options)
        if decision.hands_off:
            return None  # another controller's job (spec.managedBy): not even its status
        errors: list[WriteError] = []
        creates = [a.obj for a in decision.actions if isinstance(a, reconcile.Create)]
        for wave in creation_waves(creates):
            errors += await _bounded([self._create(obj) for obj in wave])
            if errors:
                break  # the next waves need this one (a Pod its ServiceAccount)
        decision = reconcile.after_writes(view, observed, decision, errors, self._clock())
        version = await self._write_status(job, decision, meta["resourceVersion"])
        if self.metrics is not None:
            self.metrics.job_round(namespace, name, decision.status, rendezvous)
        # Patches and Events keep their order; deletes of many pods go out together.
        later: list[WriteError] = []
        deletes = [a for a in decision.actions if isinstance(a, reconcile.Delete)]
        for action in decision.actions:
            if not isinstance(action, reconcile.Delete):
                later += await _bounded([self._apply_after(job, action)])
            elif action is deletes[0]:
                later += await _bounded([self._apply_after(job, a) for a in deletes])
        if later:
            # Refused deletes or gate lifts: said in the status too, then tried again.
            view = replace(view, status=decision.status)
            done = replace(decision, actions=())
            amended = reconcile.after_writes(view, observed, done, later, self._clock())
            await self._write_status(job, amended, version)
            if self.metrics is not None:
                self.metrics.job_round(namespace, name, amended.status, rendezvous)
            for event in amended.actions:
                if isinstance(event, reconcile.Emit):
                    await self._apply_after(job, event)
            return amended.requeue_after
        return decision.requeue_after

    async def _write_status(self, job: dict[str, Any], decision: Decision, version: str) -> str:
        """The status, conditional on ``version``; returns the job's new resourceVersion."""
        meta = job["metadata"]
        written = await self._api.merge_patch(
            API_VERSION,
            KIND,
            meta["namespace"],
            meta["name"],
            {
                "metadata": {"resourceVersion": version},
                "status": decision.status.model_dump(mode="json", by_alias=True),
            },
            subresource="status",
        )
        return str(((written or {}).get("metadata") or {}).get("resourceVersion", version))

    async def _create(self, obj: dict[str, Any]) -> WriteError | None:
        try:
            await self._api.create(obj)
        except kube.ConflictError:
            raise
        except kube.ApiError as exc:
            return _refused("create", obj["kind"], obj["metadata"]["name"], exc)
        return None

    async def _apply_after(self, job: dict[str, Any], action: Action) -> WriteError | None:
        namespace = job["metadata"]["namespace"]
        if isinstance(action, reconcile.Delete):
            try:
                await self._api.delete(action.api_version, action.kind, namespace, action.name)
            except kube.ApiError as exc:
                if action.kind == "PodGroup" and exc.status == 404:
                    return None  # no PodGroup API installed: nothing to delete
                return _refused("delete", action.kind, action.name, exc)
        elif isinstance(action, reconcile.LiftGate):
            gates = [{"name": g} for g in action.gates] or None
            patch = {
                "metadata": {"resourceVersion": action.resource_version},
                "spec": {"schedulingGates": gates},
            }
            try:
                await self._api.merge_patch("v1", "Pod", namespace, action.name, patch)
            except kube.ConflictError:
                return None  # the pod changed since it was read: the next round sees it
            except kube.ApiError as exc:
                if exc.status == 404:
                    return None
                return _refused("patch", "Pod", action.name, exc)
        elif isinstance(action, reconcile.DeleteJob):
            meta = job["metadata"]
            log.info("deleting %s/%s: its ttlSecondsAfterFinished ran out", namespace, meta["name"])
            await self._api.delete(API_VERSION, KIND, namespace, meta["name"])
        elif isinstance(action, PatchData):
            patch = {"data": dict(action.data)}
            try:
                await self._api.merge_patch("v1", "ConfigMap", namespace, action.name, patch)
            except kube.ApiError as exc:
                if exc.status != 404:
                    raise
        elif isinstance(action, reconcile.Emit):
            try:
                await self._api.post_event(job, action.type, action.reason, action.message)
            except kube.ApiError as exc:  # an Event is a courtesy; its loss must not stall
                log.warning("could not post event %s: %s", action.reason, exc)
        return None


def _refused(verb: str, kind: str, name: str, exc: kube.ApiError) -> WriteError:
    log.warning("%s %s %s refused: HTTP %s %s", verb, kind, name, exc.status, exc.message)
    return WriteError(verb, kind, name, exc.status, exc.reason, exc.message)


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


async def _bounded(
    calls: list[Coroutine[Any, Any, WriteError | None]],
) -> list[WriteError]:
    """Run API calls concurrently, at most PARALLEL_CALLS at a time.  Returns the writes the
    apiserver refused; re-raises any other error once every call has ended."""
    gate = asyncio.Semaphore(PARALLEL_CALLS)

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
