"""The shared harness of the pure reconcile's tests: a job's pods as the API returns them
(rendered by the operator's own renderers, with a uid and a status), one reconcile round
over them, and readers of the decision.  Nothing is emulated: no API is involved.

Each test module makes a :class:`Harness` for its spec; ``spec=`` on a call renders the
pods and the static children from that spec instead (a spec edit, an invalid spec).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from tests.support.rendezvous_maps import spread

from refit_operator.api.models import InvalidSpecError, RefitJobStatus, parse_spec
from refit_operator.core.decision import Create, Decision, Delete, Emit, JobView
from refit_operator.core.observe import observe
from refit_operator.core.reconcile import reconcile
from refit_operator.render.children import render_static
from refit_operator.render.pods import JobRef, RenderOptions, render_gang

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
REF = JobRef(name="job", namespace="ns", uid="u-1")
RUNNING: dict[str, Any] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
SUCCEEDED: dict[str, Any] = {"phase": "Succeeded"}
#: A pod status meaning "this pod does not exist" (left out of :meth:`Harness.pods`).
GONE = "gone"


def exited(code: int, message: str = "", *, conditions: tuple[Any, ...] = ()) -> dict[str, Any]:
    """The status of a pod whose container exited with ``code`` (Failed), its termination
    message and pod conditions as given."""
    terminated: dict[str, Any] = {"exitCode": code, "reason": "Error"}
    if message:
        terminated["message"] = message
    return {
        "phase": "Failed",
        "conditions": list(conditions),
        "containerStatuses": [{"state": {"terminated": terminated}}],
    }


def uid(name: str, epoch: int) -> str:
    return f"uid-{name}-{epoch}"


class Harness:
    """Pods and reconcile rounds of the job ``REF`` with the raw ``spec``."""

    def __init__(self, spec: dict[str, Any], *, generation: int = 1) -> None:
        self.spec = spec
        self.generation = generation

    def pods(
        self,
        epoch: int,
        spec: dict[str, Any] | None = None,
        *,
        rollout: Mapping[int, int] | None = None,
        policy: bool = True,
        **status_by_name: Any,
    ) -> list[dict[str, Any]]:
        """The epoch's policy gang and the rollout pods (``rollout``: rank -> generation,
        default every rank at generation 0) as manifests; each pod's status by name
        (default Pending), :data:`GONE` for a pod that is not there."""
        out = []
        parsed = parse_spec(spec or self.spec)
        rendered = render_gang(REF, parsed, epoch, RenderOptions(), policy=policy, rollout=rollout)
        for pod in rendered:
            name = pod["metadata"]["name"]
            if status_by_name.get(name) == GONE:
                continue
            pod["metadata"]["uid"] = uid(name, epoch)
            pod["metadata"]["resourceVersion"] = "41"
            pod["status"] = status_by_name.get(name, {"phase": "Pending"})
            out.append(pod)
        return out

    def run(
        self,
        status: RefitJobStatus,
        pods: list[dict[str, Any]],
        data: Mapping[str, str] | None = None,
        *,
        spec: Any = None,
        generation: int | None = None,
        now: datetime = NOW,
        static: bool = True,
        rendezvous: Mapping[str, Mapping[str, str]] | None = None,
    ) -> Decision:
        """One round; ``data`` is shard 0 of the rendezvous (``rendezvous``: every shard).
        With ``static``, the job's Services, ConfigMap and RBAC exist (as its own spec
        renders them; none for a spec that does not parse)."""
        raw = self.spec if spec is None else spec
        others = _static(raw) if static else []
        shards = rendezvous if rendezvous is not None else spread("job", data or {})
        job = JobView(
            ref=REF,
            generation=self.generation if generation is None else generation,
            raw_spec=raw,
            status=status,
        )
        return reconcile(job, observe(pods, others, shards), now, RenderOptions())


def _static(raw: Any) -> list[dict[str, Any]]:
    try:
        return render_static(REF, parse_spec(raw))
    except InvalidSpecError:
        return []


def creates(d: Decision) -> list[str]:
    return sorted(a.obj["metadata"]["name"] for a in d.actions if isinstance(a, Create))


def deletes(d: Decision) -> list[str]:
    return sorted(a.name for a in d.actions if isinstance(a, Delete))


def events(d: Decision) -> list[tuple[str, str]]:
    return [(a.type, a.reason) for a in d.actions if isinstance(a, Emit)]


def of(d: Decision, kind: type) -> list[Any]:
    return [a for a in d.actions if isinstance(a, kind)]


def condition(status: RefitJobStatus, kind: str) -> Any:
    return next(c for c in status.conditions if c.type == kind)
