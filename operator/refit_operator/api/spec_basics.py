"""What the operator reads of every RefitJob spec, a partly invalid one too: who manages
the job (``managedBy``), how long a finished job stays (``ttlSecondsAfterFinished``) and
how long a node may be NotReady before its pods are lost (``failurePolicy.
nodeLostSeconds``).

These are read before (or without) the strict :class:`~refit_operator.api.models.RefitJobSpec`:
a job another controller manages is left alone whatever its spec says, a finished job is
deleted on time even when its spec is invalid, and the controller decides which pods are
lost before the round validates the spec.  So :class:`SpecBasics` is a model of its own,
lenient field by field: a field that is missing or malformed reads as its default (the
strict model is the one that refuses it, in words), the rest of the spec is ignored.
For a valid spec it reads what the strict model reads.

Pure (``models.py`` builds on it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic.alias_generators import to_camel

from refit_worker.contract.bounds import MAX_LIFE_SECONDS, MAX_NODE_LOST_SECONDS

#: ``spec.failurePolicy.nodeLostSeconds`` when the spec does not say.
NODE_LOST_SECONDS = 30


class _Lenient(BaseModel):
    """JSON types exactly, as the strict model (``"5"`` is no number, ``true`` no count),
    wire names only; a field that does not validate takes its default."""

    model_config = ConfigDict(
        extra="ignore", frozen=True, strict=True, alias_generator=to_camel, populate_by_name=False
    )

    @field_validator("*", mode="wrap")
    @classmethod
    def _or_default(
        cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> Any:
        try:
            return handler(value)
        except ValidationError:
            name = info.field_name or ""
            return cls.model_fields[name].get_default(call_default_factory=True)


class FailurePolicyBasics(_Lenient):
    """Of ``spec.failurePolicy``: what the controller needs before the round."""

    #: A pod whose node is NotReady or unreachable this long is lost (0: at once).
    node_lost_seconds: float = Field(float(NODE_LOST_SECONDS), ge=0, le=MAX_NODE_LOST_SECONDS)


class SpecBasics(_Lenient):
    """The fields read of every spec, valid or not (:meth:`read`)."""

    #: Any value but unset (or this operator's name) hands the job to another controller,
    #: a malformed one too: the job is left alone rather than failed by the wrong owner.
    managed_by: Any = None
    ttl_seconds_after_finished: int | None = Field(None, ge=0, le=MAX_LIFE_SECONDS)
    failure_policy: FailurePolicyBasics = Field(default_factory=FailurePolicyBasics)

    @classmethod
    def read(cls, raw_spec: Any) -> SpecBasics:
        """The basics of ``raw_spec`` (defaults when it is not an object at all)."""
        if not isinstance(raw_spec, Mapping):
            return cls()
        return cls.model_validate(dict(raw_spec))

    @property
    def node_lost_seconds(self) -> float:
        return self.failure_policy.node_lost_seconds
