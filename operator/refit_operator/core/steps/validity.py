"""Whether the spec can run at all: it parses into ``RefitJobSpec``, its names fit the
API's limits, and its pod templates do not conflict with what the operator owns.  A spec
found invalid and then changed starts over, in a new epoch, as a new job would.
"""

from __future__ import annotations

from dataclasses import dataclass

from refit_operator.api import names
from refit_operator.api.models import (
    InvalidSpecError,
    Phase,
    RefitJobSpec,
    RefitJobStatus,
    parse_spec,
)
from refit_operator.core import conditions as cond
from refit_operator.core.decision import JobView
from refit_operator.render import pods

#: Reasons of the Failed condition that a new generation of the spec may fix.
SPEC_REASONS = frozenset({"InvalidSpec", "TemplateConflict", "ChildRejected"})


@dataclass(frozen=True)
class Invalid:
    """Why the spec cannot run: the Failed condition's reason and the words for it."""

    reason: str
    message: str


def check_spec(job: JobView, options: pods.RenderOptions) -> RefitJobSpec | Invalid:
    try:
        spec = parse_spec(job.raw_spec)
    except InvalidSpecError as exc:
        return Invalid("InvalidSpec", str(exc))
    problems = names.name_problems(job.ref.name, spec.policy.replicas, spec.rollout.replicas)
    if problems:
        return Invalid("InvalidSpec", "; ".join(problems))
    conflicts = pods.template_conflicts(job.ref, spec, options)
    if conflicts:
        return Invalid("TemplateConflict", "; ".join(conflicts))
    return spec


def retrying(job: JobView) -> bool:
    """A spec found invalid, then changed: the job starts over."""
    status = job.status
    failed = cond.get_condition(status.conditions, cond.FAILED)
    invalid = status.phase is Phase.FAILED and failed is not None and failed.reason in SPEC_REASONS
    return invalid and status.observed_generation != job.generation


def start_status(job: JobView, *, retry: bool) -> RefitJobStatus:
    """The status the round starts from: as it is, or reset for a retry in a new epoch."""
    if not retry:
        return job.status
    return job.status.model_copy(
        update={
            "message": "",
            "created_epoch": None,
            "epoch": job.status.epoch + 1,
            "epoch_start_time": None,
            "completion_time": None,
        }
    )
