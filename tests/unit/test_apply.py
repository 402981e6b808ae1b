"""The one applier both shells use (``refit_operator.apply.applier.Applier``): the order of a
round's writes, one status write per round unless a later write was refused, and the
apiserver's refusals reaching the status.

The writes go to a recording :class:`~refit_operator.apply.applier.Writes` (the applier's own
protocol, which the controller's ``KubeWrites`` and ``refit run``'s ``LocalCluster``
implement); the decisions are the pure reconcile's, from the shared harness.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tests.support.reconcile_harness import NOW, REF, Harness

from refit_operator.api.models import RefitJobStatus
from refit_operator.apply.applier import Applier
from refit_operator.core.coordinate import PatchData
from refit_operator.core.decision import Decision, Delete, Emit, JobView, LiftGate
from refit_operator.core.observe import observe
from refit_operator.core.writes import WriteError

SPEC: dict[str, Any] = {"image": "img", "policy": {"replicas": 1}, "rollout": {"replicas": 1}}
JOB = Harness(SPEC)


class Recording:
    """Every write in the order it came; ``refuse`` names writes the apiserver refuses."""

    def __init__(self, refuse: frozenset[tuple[str, str]] = frozenset()) -> None:
        self.calls: list[tuple[str, str]] = []
        self.statuses: list[RefitJobStatus] = []
        self.refuse = refuse

    def _refused(self, verb: str, kind: str, name: str) -> WriteError | None:
        self.calls.append((verb, f"{kind}/{name}"))
        if (verb, name) in self.refuse:
            return WriteError(verb, kind, name, 403, "Forbidden", "exceeded quota")
        return None

    async def create(self, obj: dict[str, Any]) -> WriteError | None:
        return self._refused("create", obj["kind"], obj["metadata"]["name"])

    async def delete(self, action: Delete) -> WriteError | None:
        return self._refused("delete", action.kind, action.name)

    async def lift_gate(self, action: LiftGate) -> WriteError | None:
        return self._refused("patch", "Pod", action.name)

    async def patch_data(self, action: PatchData) -> None:
        self.calls.append(("patch", f"ConfigMap/{action.name}"))

    async def delete_job(self) -> None:
        self.calls.append(("delete", "RefitJob"))

    async def emit(self, event: Emit) -> None:
        self.calls.append(("event", event.reason))

    async def write_status(self, status: RefitJobStatus) -> None:
        self.calls.append(("status", status.phase.value))
        self.statuses.append(status)


def _apply(writes: Recording, status: RefitJobStatus, decision: Decision) -> Decision:
    view = JobView(ref=REF, generation=1, raw_spec=SPEC, status=status)
    applier = Applier(writes, clock=lambda: NOW)
    return asyncio.run(applier.apply(view, observe([], []), decision))


def test_a_new_job_creates_in_waves_then_writes_its_status_once() -> None:
    decision = JOB.run(RefitJobStatus(), [], static=False)
    writes = Recording()
    done = _apply(writes, RefitJobStatus(), decision)
    kinds = [what.split("/")[0] for verb, what in writes.calls if verb == "create"]
    # ServiceAccount, Role, Services, ConfigMap; then the RoleBinding; the pods last.
    assert kinds.index("RoleBinding") > max(kinds.index("Role"), kinds.index("ServiceAccount"))
    assert kinds[-2:] == ["Pod", "Pod"]
    assert [c for c in writes.calls if c[0] == "status"] == [("status", "Pending")]
    assert writes.calls[-1] == ("status", "Pending")
    assert done.status.created_epoch == 0 and writes.statuses == [done.status]


def test_a_refused_pod_create_is_in_the_one_status_and_not_recorded_as_created() -> None:
    decision = JOB.run(RefitJobStatus(), [], static=False)
    writes = Recording(refuse=frozenset({("create", "job-rollout-0-g0")}))
    done = _apply(writes, RefitJobStatus(), decision)
    assert len(writes.statuses) == 1
    assert done.status.created_epoch is None  # the next round creates the rest
    assert "create Pod job-rollout-0-g0: HTTP 403: exceeded quota" in done.status.message
    assert ("event", "FailedCreate") in writes.calls
    assert writes.calls.index(("event", "FailedCreate")) > writes.calls.index(("status", "Pending"))


def test_status_goes_before_deletes_and_again_only_when_a_later_write_was_refused() -> None:
    failed = {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {"exitCode": 1}}}]}
    status = RefitJobStatus(created_epoch=0)
    decision = JOB.run(status, JOB.pods(0, **{"job-policy-0-e0": failed}))
    clean = Recording()
    _apply(clean, status, decision)
    first_delete = next(i for i, c in enumerate(clean.calls) if c[0] == "delete")
    assert clean.calls.index(("status", "Restarting")) < first_delete
    assert len(clean.statuses) == 1
    refused = Recording(refuse=frozenset({("delete", "job-policy-0-e0")}))
    done = _apply(refused, status, decision)
    assert len(refused.statuses) == 2  # the refusal must be said
    said = next(c for c in done.status.conditions if c.type == "ChildFailure")
    assert (said.status, said.reason) == ("True", "Forbidden")
    assert "delete Pod job-policy-0-e0: HTTP 403" in said.message
    assert refused.calls[-1] == ("event", "FailedDelete")
