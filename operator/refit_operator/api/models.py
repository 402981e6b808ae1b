"""The ``RefitJob`` API: pydantic models of spec and status, the one source of the schema.

``crd.py`` generates the CRD's OpenAPI schema from these models; handlers parse the raw
spec with :func:`parse_spec` before anything else.  Field names are camelCase on the wire
(Kubernetes convention) and snake_case in Python.

What the worker must agree with comes from ``refit_worker.contract``: the signal vocabulary
(the CRD's signal pattern included), the transfer knobs (``TransferSpec`` extends
``TransferKnobs``), the synthetic weights model with its dtype names, the env prefix and the
rendezvous size limit.

Pure: the local runner and the CRD generator use it.
"""

from __future__ import annotations

import signal as _signal
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from refit_operator.api.names import MASTER_PORT
from refit_operator.api.podtemplate import summarise
from refit_operator.api.quantity import (
    BUCKET_SIZE_PATTERN,
    BUCKET_SIZE_RANGE,
    BucketSize,
    parse_quantity,
)
from refit_operator.api.roles import (
    ENV_NAME_PATTERN,
    POLICY_FAILURE_POLICY_REFUSED,
    RESOURCE_QUANTITY_PATTERN,
    GangSpec,
    RoleSpec,
    RolloutFailurePolicy,
)
from refit_operator.api.spec_basics import NODE_LOST_SECONDS, SpecBasics
from refit_operator.api.status import (
    Condition,
    Phase,
    PodBytes,
    RefitJobStatus,
    RoleStatus,
    RolloutReplica,
    parse_status,
)
from refit_operator.api.wire import WIRE, Wire
from refit_worker.contract.bounds import (
    MAX_BACKOFF_SECONDS,
    MAX_LIFE_SECONDS,
    MAX_NODE_LOST_SECONDS,
    MAX_RESTARTS,
    MAX_START_SECONDS,
)
from refit_worker.contract.config import SyntheticWeights, TransferKnobs
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
#: ``spec.managedBy`` of the jobs this operator reconciles (unset means the same).
MANAGER_NAME = f"{GROUP}/refit-operator"
#: A domain-prefixed path, as JobSet's and Job's ``managedBy`` (``kueue.x-k8s.io/multikueue``).
MANAGED_BY_PATTERN = (
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[-a-zA-Z0-9_.]+$"
)

__all__ = [
    "API_VERSION",
    "BUCKET_SIZE_PATTERN",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "Condition",
    "GangSpec",
    "InvalidSpecError",
    "Phase",
    "PodBytes",
    "RefitJobSpec",
    "RefitJobStatus",
    "RoleSpec",
    "RoleStatus",
    "RolloutFailurePolicy",
    "RolloutReplica",
    "SpecBasics",
    "managed_elsewhere",
    "parse_spec",
    "parse_status",
]

#: DNS-1123 subdomain: what names a PersistentVolumeClaim.
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class SafetensorsVolume(Wire):
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


class WeightsSpec(Wire):
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


class WorkerMetricsSpec(Wire):
    """Each rank serves its own refit figures for Prometheus at ``:port/metrics``."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.port != {MASTER_PORT}",
                    "message": f"metrics.port {MASTER_PORT} is the ranks' rendezvous port",
                }
            ]
        }
    )
    port: int = Field(
        ge=1024,
        le=65535,
        description="The worker container's port named 'metrics' (1024-65535: the pods run"
        " as non-root).",
    )

    @model_validator(mode="after")
    def _not_rendezvous(self) -> WorkerMetricsSpec:
        if self.port == MASTER_PORT:
            raise ValueError(f"metrics.port {MASTER_PORT} is the ranks' rendezvous port")
        return self


#: Why ``transfer.releaseAfterRefit: true`` is refused, at apply time and by the models.
RELEASE_AFTER_REFIT_UNSUPPORTED = (
    "transfer.releaseAfterRefit: true is not supported yet: the rollout ranks keep their"
    " receive buffers registered between refits (leave it unset or false)"
)


class TransferSpec(TransferKnobs):
    """NIXL transfer knobs, handed to the worker's checkpoint engine."""

    # The knobs are the worker's own (TransferKnobs, in the contract; the docstring above
    # is the CRD's description); the bucket size is a Kubernetes quantity here and bytes in
    # the worker's TransferConfig.
    model_config = ConfigDict(
        **WIRE,
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.releaseAfterRefit) || !self.releaseAfterRefit",
                    "message": RELEASE_AFTER_REFIT_UNSUPPORTED,
                }
            ]
        },
    )

    bucket_size: BucketSize = Field(
        "64Mi",
        description="Bytes per transfer bucket: a whole number, or a string with an optional"
        f" suffix, e.g. 64Mi or 1048576; {BUCKET_SIZE_RANGE}. Every rank allocates two"
        " buckets in full, however small the model.",
    )

    @field_validator("release_after_refit")
    @classmethod
    def _keeps_buffers(cls, value: bool) -> bool:
        if value:
            raise ValueError(RELEASE_AFTER_REFIT_UNSUPPORTED)
        return value

    @property
    def bucket_bytes(self) -> int:
        return parse_quantity(self.bucket_size)


Injection = Literal["auto", "stopSignal", "preStop"]


class PreemptionSpec(Wire):
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


#: Preemptions of the policy gang before the job fails: a drain or two a day over a week
#: of training stays well under it; a loop of them (a node that keeps being drained, a
#: stop nobody can explain) ends.
MAX_PREEMPTIONS_DEFAULT = 20


class FailurePolicy(Wire):
    """Restarts after real failures; preemptions never use these up, and have their own
    bound."""

    max_restarts: int = Field(3, ge=0, le=MAX_RESTARTS, description=f"At most {MAX_RESTARTS}.")
    max_preemptions: int = Field(
        MAX_PREEMPTIONS_DEFAULT,
        ge=0,
        le=MAX_RESTARTS,
        description="Preemptions of the policy gang (a drain, an eviction, a lost node) "
        "before the job fails, counted apart from maxRestarts: a loop of them ends the "
        f"job with a message (at most {MAX_RESTARTS}).",
    )
    backoff_seconds: float = Field(
        10.0,
        ge=0,
        le=MAX_BACKOFF_SECONDS,
        description=f"Doubles per restart (at most {MAX_BACKOFF_SECONDS}: a day).",
    )
    max_backoff_seconds: float = Field(
        300.0, ge=0, le=MAX_BACKOFF_SECONDS, description=f"At most {MAX_BACKOFF_SECONDS}: a day."
    )
    node_lost_seconds: int = Field(
        NODE_LOST_SECONDS,
        ge=1,
        le=MAX_NODE_LOST_SECONDS,
        description="A pod whose node is NotReady or unreachable this long is lost: its"
        " replica is replaced, or the policy gang restarted, without waiting for it (at most"
        f" {MAX_NODE_LOST_SECONDS}: a day).",
    )


class RefitJobSpec(Wire):
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
                },
                {
                    "rule": "!has(self.policy) || !has(self.policy.failurePolicy)",
                    "message": POLICY_FAILURE_POLICY_REFUSED,
                },
                {
                    # A transition rule: checked on updates only.
                    "rule": "has(self.managedBy) == has(oldSelf.managedBy)"
                    " && (!has(self.managedBy) || self.managedBy == oldSelf.managedBy)",
                    "message": "managedBy is immutable",
                },
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
    metrics: WorkerMetricsSpec | None = Field(
        None,
        description="Set a port to have every rank serve its refit figures for Prometheus"
        " (scrape the pods, e.g. with a PodMonitor); unset: the ranks serve none.",
    )
    create_service_account: bool = Field(
        True,
        description="Pods whose template names no serviceAccountName run as a per-job"
        " ServiceAccount allowed only its rendezvous.",
    )
    suspend: bool = Field(
        False, description="True: no pods run (and none are created); Kueue admits by clearing it."
    )
    managed_by: str | None = Field(
        None,
        max_length=63,
        pattern=MANAGED_BY_PATTERN,
        description=f"The controller that reconciles this job; unset or {MANAGER_NAME!r}:"
        " this operator, which leaves any other value alone (e.g. kueue.x-k8s.io/multikueue).",
    )
    gang: GangSpec = Field(default_factory=GangSpec)
    ttl_seconds_after_finished: int | None = Field(
        None,
        ge=0,
        le=MAX_LIFE_SECONDS,
        description="Delete the job, and so its children, this long after it ends (at most"
        f" {MAX_LIFE_SECONDS}: a year).",
    )
    active_deadline_seconds: int | None = Field(
        None,
        ge=1,
        le=MAX_LIFE_SECONDS,
        description="Fail the job once it has run this long, suspended time aside (at most"
        f" {MAX_LIFE_SECONDS}: a year).",
    )
    start_deadline_seconds: int = Field(
        1800,
        ge=1,
        le=MAX_START_SECONDS,
        description="Fail an epoch whose pods are not all Ready this long after its first pod"
        " was created; the message says why (ImagePullBackOff, Unschedulable, ...). At most"
        f" {MAX_START_SECONDS}: a week.",
    )

    @model_validator(mode="after")
    def _policy_has_no_role_failure_policy(self) -> RefitJobSpec:
        if self.policy.failure_policy is not None:
            raise ValueError(POLICY_FAILURE_POLICY_REFUSED)
        return self

    @property
    def rollout_failure_policy(self) -> RolloutFailurePolicy:
        return self.rollout.failure_policy or RolloutFailurePolicy()

    @model_validator(mode="after")
    def _rendezvous_fits(self) -> RefitJobSpec:
        total = self.policy.replicas + self.rollout.replicas
        if total > MAX_RANKS:
            raise ValueError(
                f"policy.replicas + rollout.replicas = {total} is over {MAX_RANKS},"
                " the most ranks one rendezvous serves"
            )
        return self


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


#: Patterns said in words: a regex in an error message helps nobody.
_PATTERN_WORDS = {
    RESOURCE_QUANTITY_PATTERN: "must be a Kubernetes quantity such as 500m, 8Gi or 2",
    DNS_SUBDOMAIN_PATTERN: "must be a DNS-1123 subdomain (lowercase letters, digits, '-', '.')",
    ENV_NAME_PATTERN: "must be a C identifier (letters, digits, '_'; not starting with a digit)",
}


def managed_elsewhere(spec: Any) -> bool:
    """Whether another controller reconciles this job (``spec.managedBy``): such a job is
    left alone, valid or not.  ``spec``: its :class:`SpecBasics`, or the raw spec."""
    basics = spec if isinstance(spec, SpecBasics) else SpecBasics.read(spec)
    return basics.managed_by not in (None, MANAGER_NAME)


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        if err["type"] == "pod_template":
            parts.append(summarise([where + p for p in (err.get("ctx") or {})["problems"]]))
            continue
        got = err.get("input")
        shown = f" (got {got!r})" if err["type"] != "missing" and not isinstance(got, dict) else ""
        message = err["msg"]
        if err["type"] == "string_pattern_mismatch":
            message = _PATTERN_WORDS.get(str((err.get("ctx") or {}).get("pattern")), message)
        parts.append(f"{where}: {message}{shown}")
    return "; ".join(parts)
