"""The pods of one role, as the spec shapes them: the short form (replicas, resources,
env, command), a standard pod template, and how the gang reaches the scheduler.

The template's schema is the upstream PodTemplateSpec (``podtemplate.py``); what the
operator merges into it, and which templates conflict with that, is ``render/merge.py``'s.

Pure.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    PlainValidator,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError

from refit_operator.api.podtemplate import pod_template_schema, template_problems
from refit_operator.api.wire import Wire
from refit_worker.contract.bounds import MAX_BACKOFF_SECONDS, MAX_RESTARTS, MAX_START_SECONDS
from refit_worker.contract.env import ENV_PREFIX

#: A non-negative Kubernetes quantity as the API server reads one ('500m', '8Gi', '1e3'):
#: '8 GB' or 'lots' is refused when the job is applied, not when its pods are created.
#: An unquoted whole number (``nvidia.com/gpu: 1``) is one too: the CRD's int-or-string.
RESOURCE_QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
QUANTITY_MAX_LENGTH = 64


def _quantity(value: Any) -> int | str:
    """One check for both forms, so an error reads as one sentence, not per union arm."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("a quantity must not be negative")
        return value
    if not isinstance(value, str):
        raise ValueError(
            "must be a Kubernetes quantity: a whole number or a string such as 500m or 8Gi"
        )
    if len(value) > QUANTITY_MAX_LENGTH or not re.fullmatch(
        RESOURCE_QUANTITY_PATTERN[:-1] + r"\Z", value
    ):
        raise ValueError("must be a Kubernetes quantity such as 500m, 8Gi or 2")
    return value


#: An integer or a quantity string: the CRD node is ``x-kubernetes-int-or-string``, with the
#: quantity grammar for strings and no negative numbers.
ResourceQuantity = Annotated[
    int | str,
    PlainValidator(_quantity),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": RESOURCE_QUANTITY_PATTERN,
            "maxLength": QUANTITY_MAX_LENGTH,
            "minimum": 0,
        }
    ),
]
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"


class EnvVar(Wire):
    """An extra environment variable for the worker container."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"!self.name.startsWith('{ENV_PREFIX}')",
                    "message": f"env names starting {ENV_PREFIX} are reserved"
                    " for the worker config",
                }
            ]
        }
    )

    name: str = Field(pattern=ENV_NAME_PATTERN, max_length=253)
    value: str = ""

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name.startswith(ENV_PREFIX):
            raise ValueError(
                f"env name {name!r} is reserved: {ENV_PREFIX}* carries the worker config"
            )
        return name


class Resources(Wire):
    """Container resources; values are Kubernetes quantities."""

    requests: dict[str, ResourceQuantity] = Field(default_factory=dict)
    limits: dict[str, ResourceQuantity] = Field(default_factory=dict)


def _valid_template(template: dict[str, Any]) -> dict[str, Any]:
    problems = template_problems(template)
    if problems:
        raise PydanticCustomError("pod_template", "{problems}", {"problems": problems})
    return template


#: A standard ``PodTemplateSpec``, checked against the upstream schema the CRD embeds.
PodTemplate = Annotated[
    dict[str, Any],
    AfterValidator(_valid_template),
    WithJsonSchema(pod_template_schema()),
]


class RolloutFailurePolicy(Wire):
    """How rollout replicas are replaced, one by one, apart from the policy gang's restarts."""

    max_replacements: int = Field(
        20,
        ge=0,
        le=MAX_RESTARTS,
        description="Replacements after a failure before the job fails; preemptions (drain,"
        f" eviction, a lost node) never use these up. At most {MAX_RESTARTS}.",
    )
    backoff_seconds: float = Field(
        1.0,
        ge=0,
        le=MAX_BACKOFF_SECONDS,
        description="Doubles per failure of the same rank in a row (at most"
        f" {MAX_BACKOFF_SECONDS}: a day).",
    )
    max_backoff_seconds: float = Field(
        30.0, ge=0, le=MAX_BACKOFF_SECONDS, description=f"At most {MAX_BACKOFF_SECONDS}: a day."
    )


#: Why ``policy.failurePolicy`` is refused (the CRD's rule and the model say the same).
POLICY_FAILURE_POLICY_REFUSED = (
    "policy.failurePolicy is not allowed: the policy gang restarts together under"
    " spec.failurePolicy; a per-role failurePolicy is rollout's only"
)


class RoleSpec(Wire):
    """Pods of one role (policy or rollout): the short form, and a pod template."""

    replicas: int = Field(1, ge=1, le=4096, description="Ranks in this role.")
    resources: Resources = Field(default_factory=Resources)
    env: list[EnvVar] = Field(default_factory=list)
    command: list[str] = Field(default_factory=list, description="Overrides refit-worker.")
    args: list[str] = Field(default_factory=list)
    template: PodTemplate | None = Field(
        None,
        description="The role's pods: a standard PodTemplateSpec the operator merges its own"
        " parts into (the container named 'worker' runs the rank).",
    )
    failure_policy: RolloutFailurePolicy | None = Field(
        None,
        description="Rollout only: how a failed or lost replica is replaced alone (the"
        " defaults when unset).",
    )


GangAdmission = Literal["SchedulingGates", "PodGroup", "None"]


class PodGroupSpec(Wire):
    """The PodGroup a gang scheduler admits the gang by (gang.admission: PodGroup)."""

    scheduler: Literal["Volcano", "Coscheduling"] = Field(
        "Volcano",
        description="Volcano (scheduling.volcano.sh PodGroup) or the scheduler-plugins"
        " coscheduling plugin (scheduling.x-k8s.io PodGroup).",
    )
    scheduler_name: str = Field(
        "",
        max_length=253,
        description="The pods' schedulerName when their template names none; empty:"
        " 'volcano', or 'scheduler-plugins-scheduler' for Coscheduling.",
    )
    queue: str = Field("", max_length=253, description="Volcano: the queue of the PodGroup.")
    schedule_timeout_seconds: int | None = Field(
        None,
        ge=1,
        le=MAX_START_SECONDS,
        description="Coscheduling: how long a partly placed gang may wait (at most"
        f" {MAX_START_SECONDS}: a week).",
    )


class GangSpec(Wire):
    """How the gang reaches the scheduler: all of an epoch's pods, or none."""

    admission: GangAdmission = Field(
        "SchedulingGates",
        description="SchedulingGates: pods are created gated and released together once all"
        " exist; PodGroup: a gang scheduler places all or none; None: pods go to the"
        " scheduler as they are created.",
    )
    pod_group: PodGroupSpec = Field(default_factory=PodGroupSpec)
