"""The ``RefitJob`` API: pydantic models of spec and status, the one source of the schema.

``crd.py`` generates the CRD's OpenAPI schema from these models; handlers parse the raw
spec with :func:`parse_spec` before anything else.  Field names are camelCase on the wire
(Kubernetes convention) and snake_case in Python.

What the worker must agree with comes from ``refit_worker.contract``: the signal vocabulary
(the CRD's signal pattern included), the transfer knobs (``TransferSpec`` extends
``TransferKnobs``), the synthetic weights model with its dtype names, the env prefix and the
rendezvous size limit.

Must not import: kopf, kubernetes, aiohttp (pure; the local runner and the CRD generator use
it); of the worker only ``refit_worker.contract``.
"""

from __future__ import annotations

import re
import signal as _signal
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from refit_operator.quantity import QuantityError, parse_quantity
from refit_worker.contract.config import SyntheticWeights, TransferKnobs
from refit_worker.contract.env import ENV_PREFIX
from refit_worker.contract.rendezvous import MAX_RANKS
from refit_worker.contract.signals import (
    KUBELET_STOP_SIGNALS,
    SIGNAL_PATTERN,
    canonical_name,
    signal_from_name,
)

GROUP = "refit.dev"
VERSION = "v1alpha1"
KIND = "RefitJob"
PLURAL = "refitjobs"
API_VERSION = f"{GROUP}/{VERSION}"

#: A whole number of bytes above 0 with an optional suffix: what the CRD accepts for
#: bucketSize, and (with the validator's clearer messages) what the model accepts.
BUCKET_SIZE_PATTERN = r"^[0-9]*[1-9][0-9]*(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"


#: Every wire model's config.  No inf/nan: JSON, and so the API server, cannot carry them.
_WIRE = ConfigDict(
    extra="forbid",
    frozen=True,
    alias_generator=to_camel,
    populate_by_name=True,
    allow_inf_nan=False,
)


class _Wire(BaseModel):
    model_config = _WIRE


#: A non-negative Kubernetes quantity as the API server reads one ('500m', '8Gi', '1e3'):
#: '8 GB' or 'lots' is refused when the job is applied, not when its pods are created.
RESOURCE_QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
ResourceQuantity = Annotated[str, Field(pattern=RESOURCE_QUANTITY_PATTERN, max_length=64)]
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
#: DNS-1123 subdomain: what names a PersistentVolumeClaim.
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class EnvVar(_Wire):
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


class Resources(_Wire):
    """Container resources; values are Kubernetes quantities."""

    requests: dict[str, ResourceQuantity] = Field(default_factory=dict)
    limits: dict[str, ResourceQuantity] = Field(default_factory=dict)


class RoleSpec(_Wire):
    """Pods of one role (policy or rollout)."""

    replicas: int = Field(1, ge=1, le=4096, description="Ranks in this role.")
    resources: Resources = Field(default_factory=Resources)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] = Field(default_factory=dict)
    env: list[EnvVar] = Field(default_factory=list)
    command: list[str] = Field(default_factory=list, description="Overrides refit-worker.")
    args: list[str] = Field(default_factory=list)
    service_account_name: str = Field("", description="Empty: the per-job account.")


class SafetensorsVolume(_Wire):
    """A directory of ``*.safetensors`` files on a PersistentVolumeClaim."""

    claim_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="A PersistentVolumeClaim in the job's namespace.",
    )
    path: str = Field(
        "",
        max_length=1024,
        description="Directory inside the volume (relative, no '..').",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    # Plain CEL string functions: the API server and the offline judge agree.
                    "rule": "!self.startsWith('/') && self != '..' && !self.startsWith('../')"
                    " && !self.endsWith('/..') && !self.contains('/../')",
                    "message": "path must be relative to the volume, without '..'",
                }
            ]
        },
    )

    @field_validator("path")
    @classmethod
    def _inside_volume(cls, value: str) -> str:
        if value.startswith("/") or ".." in value.split("/"):
            raise ValueError(f"path {value!r} must be relative to the volume, without '..'")
        return value


class WeightsSpec(_Wire):
    """What to stream: exactly one of ``synthetic`` and ``safetensors``."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.synthetic) != has(self.safetensors)",
                    "message": "set exactly one of weights.synthetic and weights.safetensors",
                }
            ]
        }
    )
    synthetic: SyntheticWeights | None = None
    safetensors: SafetensorsVolume | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> WeightsSpec:
        if (self.synthetic is None) == (self.safetensors is None):
            raise ValueError("set exactly one of weights.synthetic and weights.safetensors")
        return self


class TransferSpec(TransferKnobs):
    """NIXL transfer knobs, handed to the worker's checkpoint engine."""

    # The knobs are the worker's own (TransferKnobs, in the contract; the docstring above
    # is the CRD's description); the bucket size is a Kubernetes quantity here and bytes in
    # the worker's TransferConfig.
    model_config = _WIRE

    bucket_size: str = Field(
        "64Mi",
        description="Bytes per transfer bucket: a whole number with an optional suffix, e.g. 64Mi",
        json_schema_extra={"pattern": BUCKET_SIZE_PATTERN},
    )

    @field_validator("bucket_size")
    @classmethod
    def _positive(cls, value: str) -> str:
        unreadable = ValueError(
            f"bucketSize {value!r} is not a whole number of bytes with an optional suffix,"
            " such as 64Mi, 1Gi or 1048576"
        )
        try:
            size = parse_quantity(value)
        except QuantityError as exc:
            raise unreadable from exc
        if size <= 0:
            raise ValueError(f"bucketSize {value!r} must be more than 0 bytes")
        if "." in value:
            raise ValueError(
                f"bucketSize {value!r} must be a whole number with an optional"
                f" suffix, without a fraction: write {str(size)!r}"
            )
        # Last, the CRD's own pattern: the API server and the models refuse alike.
        if not re.fullmatch(BUCKET_SIZE_PATTERN, value):
            raise unreadable
        return value

    @property
    def bucket_bytes(self) -> int:
        return parse_quantity(self.bucket_size)


Injection = Literal["auto", "stopSignal", "preStop"]


class PreemptionSpec(_Wire):
    """Which signal announces a preemption, and how the pod gets it."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.injection != 'stopSignal' || self.signal in "
                    + "["
                    + ", ".join(f"'{s}'" for s in KUBELET_STOP_SIGNALS)
                    + "]",
                    "message": "injection stopSignal needs a signal name the kubelet accepts,"
                    " e.g. SIGTERM or SIGUSR1",
                }
            ]
        }
    )
    signal: str = Field(
        "SIGTERM", min_length=1, max_length=16, json_schema_extra={"pattern": SIGNAL_PATTERN}
    )
    grace_period_seconds: int = Field(30, ge=1, le=86400)
    injection: Injection = "auto"

    @field_validator("signal")
    @classmethod
    def _known(cls, value: str) -> str:
        if not value.isascii() or value != value.strip():
            raise ValueError(f"signal name {value!r} must be ASCII with no surrounding spaces")
        canonical_name(value)
        return value

    @model_validator(mode="after")
    def _kubelet_name(self) -> PreemptionSpec:
        if self.injection == "stopSignal" and self.signal not in KUBELET_STOP_SIGNALS:
            raise ValueError(
                f"injection stopSignal needs a signal name the kubelet accepts, got"
                f" {self.signal!r} (write it as {canonical_name(self.signal)!r})"
            )
        return self

    @property
    def parsed_signal(self) -> _signal.Signals:
        """The signal as the worker listens for it (validated: known and catchable)."""
        return signal_from_name(self.signal)

    @property
    def signal_name(self) -> str:
        """The canonical name (``SIGUSR1``): what ``lifecycle.stopSignal`` takes."""
        return self.parsed_signal.name


class FailurePolicy(_Wire):
    """Restarts after real failures; preemptions never use these up."""

    max_restarts: int = Field(3, ge=0)
    backoff_seconds: float = Field(10.0, ge=0, description="Doubles per restart.")
    max_backoff_seconds: float = Field(300.0, ge=0)


class RefitJobSpec(_Wire):
    """The desired state of a RefitJob."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "(has(self.policy) ? self.policy.replicas : 1)"
                    " + (has(self.rollout) ? self.rollout.replicas : 1)"
                    f" <= {MAX_RANKS}",
                    "message": f"policy.replicas + rollout.replicas must be at most {MAX_RANKS},"
                    " the most ranks one rendezvous serves",
                }
            ]
        }
    )

    image: str = Field(min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    policy: RoleSpec = Field(default_factory=RoleSpec)
    rollout: RoleSpec = Field(default_factory=RoleSpec)
    weights: WeightsSpec = Field(default_factory=lambda: WeightsSpec(synthetic=SyntheticWeights()))
    transfer: TransferSpec = Field(default_factory=TransferSpec)
    preemption: PreemptionSpec = Field(default_factory=PreemptionSpec)
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy)
    create_service_account: bool = Field(
        True, description="Create a per-job ServiceAccount allowed only its rendezvous."
    )
    suspend: bool = False

    @model_validator(mode="after")
    def _rendezvous_fits(self) -> RefitJobSpec:
        total = self.policy.replicas + self.rollout.replicas
        if total > MAX_RANKS:
            raise ValueError(
                f"policy.replicas + rollout.replicas = {total} is over {MAX_RANKS},"
                " the most ranks one rendezvous serves"
            )
        return self


class Phase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class _Status(BaseModel):
    # Status tolerates unknown keys: other writers (kubectl, older operators) may add some.
    model_config = ConfigDict(
        extra="ignore", frozen=True, alias_generator=to_camel, populate_by_name=True
    )


class Condition(_Status):
    """A Kubernetes-style condition."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: datetime


class RoleStatus(_Status):
    ready: int = 0
    total: int = 0


class RefitJobStatus(_Status):
    """The observed state of a RefitJob, written only by the operator."""

    phase: Phase = Phase.PENDING
    message: str = ""
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int = 0
    epoch: int = 0
    #: The epoch whose pods have been created (None: not yet for the current epoch).
    created_epoch: int | None = None
    #: Not before this time is the gang of the current epoch (re)created.
    restart_at: datetime | None = None
    policy: RoleStatus = Field(default_factory=RoleStatus)
    rollout: RoleStatus = Field(default_factory=RoleStatus)
    restarts: int = 0
    preemptions: int = 0
    refits_completed: int = 0
    #: Bytes rollout ranks received, over all epochs.
    bytes_transferred: int = 0
    #: Bytes of the epochs before the current one (the epoch's own bytes come on top).
    bytes_before_epoch: int = 0
    #: Of those, the bytes the previous epoch's ranks reported: reports that land after the
    #: gang stopped are added until its rendezvous is cleared.
    previous_epoch_bytes: int = 0
    #: How every committed refit was checked, as the rollout ranks reported: "bit-exact",
    #: "checksums", "manifest" or "none" (the weakest any rank applied).
    verification: str = "none"
    last_throughput_bytes_per_second: float | None = None
    start_time: datetime | None = None
    completion_time: datetime | None = None


class InvalidSpecError(ValueError):
    """The manifest does not describe a valid RefitJob; the message says what is wrong."""


def parse_spec(raw: Any) -> RefitJobSpec:
    """Turn the raw ``spec`` into a :class:`RefitJobSpec`, or raise InvalidSpecError."""
    if not isinstance(raw, dict):
        raise InvalidSpecError(f"spec must be an object, got {type(raw).__name__}")
    try:
        # As the API server judges: JSON types exactly ("3" is no integer), wire names only.
        return RefitJobSpec.model_validate(raw, strict=True, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise InvalidSpecError(_describe(exc)) from exc


def parse_status(raw: Any) -> RefitJobStatus:
    """Read a stored status; an unreadable one counts as empty (the operator rewrites it)."""
    if not isinstance(raw, dict):
        return RefitJobStatus()
    try:
        return RefitJobStatus.model_validate(raw)
    except ValidationError:
        return RefitJobStatus()


#: Patterns said in words: a regex in an error message helps nobody.
_PATTERN_WORDS = {
    RESOURCE_QUANTITY_PATTERN: "must be a Kubernetes quantity such as 500m, 8Gi or 2",
    DNS_SUBDOMAIN_PATTERN: "must be a DNS-1123 subdomain (lowercase letters, digits, '-', '.')",
    ENV_NAME_PATTERN: "must be a C identifier (letters, digits, '_'; not starting with a digit)",
}


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        got = err.get("input")
        shown = f" (got {got!r})" if err["type"] != "missing" and not isinstance(got, dict) else ""
        message = err["msg"]
        if err["type"] == "string_pattern_mismatch":
            message = _PATTERN_WORDS.get(str((err.get("ctx") or {}).get("pattern")), message)
        parts.append(f"{where}: {message}{shown}")
    return "; ".join(parts)
