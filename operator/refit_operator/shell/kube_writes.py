"""The controller's :class:`~refit_operator.apply.applier.Writes`: one RefitJob's writes against
the API server, with the tolerance each one needs (a PodGroup API that is not installed,
a pod gone or changed before its gate is lifted, an Event that cannot be posted).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from refit_operator.api.models import API_VERSION, KIND, RefitJobStatus
from refit_operator.apply import fresh_key
from refit_operator.core.coordinate import PatchData
from refit_operator.core.decision import Delete, Emit, LiftGate
from refit_operator.core.writes import WriteError
from refit_operator.shell import kube

log = logging.getLogger(__name__)


class KubeWrites:
    """Writes of one round of one job; the status write is conditional on the
    resourceVersion the round read (and then on the one each write returns)."""

    def __init__(
        self,
        api: kube.Kube,
        job: dict[str, Any],
        *,
        on_status: Callable[[RefitJobStatus], None] = lambda s: None,
    ) -> None:
        self._api = api
        self._job = job
        self._namespace = str(job["metadata"]["namespace"])
        self._version = str(job["metadata"]["resourceVersion"])
        self._on_status = on_status

    async def create(self, obj: dict[str, Any]) -> WriteError | None:
        filled = fresh_key.with_fresh_key(obj)
        try:
            await self._api.create(filled)
        except kube.ConflictError:
            raise
        except kube.ApiError as exc:
            return _refused("create", obj["kind"], obj["metadata"]["name"], exc)
        if (event := fresh_key.created_event(filled)) is not None:
            await self.emit(event)  # which key the job's refits are sealed with
        return None

    async def delete(self, action: Delete) -> WriteError | None:
        options = _delete_options(action)
        try:
            await self._api.delete(
                action.api_version, action.kind, self._namespace, action.name, options=options
            )
        except kube.ApiError as exc:
            if action.kind == "PodGroup" and exc.status == 404:
                return None  # no PodGroup API installed: nothing to delete
            if action.uid is not None and exc.status == 409:
                return None  # the uid precondition: that pod is gone, a successor has the name
            return _refused("delete", action.kind, action.name, exc)
        return None

    async def lift_gate(self, action: LiftGate) -> WriteError | None:
        gates = [{"name": g} for g in action.gates] or None
        patch = {
            "metadata": {"resourceVersion": action.resource_version},
            "spec": {"schedulingGates": gates},
        }
        try:
            await self._api.merge_patch("v1", "Pod", self._namespace, action.name, patch)
        except kube.ConflictError:
            return None  # the pod changed since it was read: the next round sees it
        except kube.ApiError as exc:
            if exc.status == 404:
                return None
            return _refused("patch", "Pod", action.name, exc)
        return None

    async def patch_data(self, action: PatchData) -> None:
        patch = {"data": dict(action.data)}
        try:
            await self._api.merge_patch("v1", "ConfigMap", self._namespace, action.name, patch)
        except kube.ApiError as exc:
            if exc.status != 404:
                raise

    async def delete_job(self) -> None:
        name = self._job["metadata"]["name"]
        log.info("deleting %s/%s: its ttlSecondsAfterFinished ran out", self._namespace, name)
        await self._api.delete(API_VERSION, KIND, self._namespace, name)

    async def emit(self, event: Emit) -> None:
        try:
            await self._api.post_event(self._job, event.type, event.reason, event.message)
        except kube.ApiError as exc:  # an Event is a courtesy; its loss must not stall
            log.warning("could not post event %s: %s", event.reason, exc)

    async def write_status(self, status: RefitJobStatus) -> None:
        meta = self._job["metadata"]
        written = await self._api.merge_patch(
            API_VERSION,
            KIND,
            meta["namespace"],
            meta["name"],
            {
                "metadata": {"resourceVersion": self._version},
                "status": status.model_dump(mode="json", by_alias=True),
            },
            subresource="status",
        )
        self._version = str(
            ((written or {}).get("metadata") or {}).get("resourceVersion", self._version)
        )
        self._on_status(status)


def _delete_options(action: Delete) -> dict[str, Any] | None:
    """``DeleteOptions`` of a delete that asks for more than the default (a force delete:
    grace 0, only the pod of that uid)."""
    options: dict[str, Any] = {}
    if action.grace_period_seconds is not None:
        options["gracePeriodSeconds"] = action.grace_period_seconds
    if action.uid is not None:
        options["preconditions"] = {"uid": action.uid}
    return options or None


def _refused(verb: str, kind: str, name: str, exc: kube.ApiError) -> WriteError:
    log.warning("%s %s %s refused: HTTP %s %s", verb, kind, name, exc.status, exc.message)
    return WriteError(verb, kind, name, exc.status, exc.reason, exc.message)
