"""Pure target-weight layouts: which experts and tensor-parallel slices a rollout rank holds.

A rollout rank declares a :class:`TargetWeightLayout`; it travels in the rank's metadata
and its sender applies :func:`select_slice` to every tensor, sending only what is wanted.
Names are matched by configurable regular expressions, so nothing is tied to one model:

* ``expert_pattern`` must have a named group ``expert``; a tensor whose name matches is sent
  only when that expert id is in ``expert_ids`` (``None`` means every expert);
* ``tp_dims`` maps a name pattern to the dimension that tensor parallelism splits; a match
  is cut into ``tp_size`` equal parts along that dimension and part ``tp_rank`` is sent;
* ``slices`` names, tensor by tensor, the ``(dim, start, stop)`` a rank holds: what an
  engine declares from its own sharding (uneven parts such as a padded vocabulary's last
  rank, q/k/v heads replicated over ranks), which no equal split can say.  It wins over
  ``tp_dims``; a name in neither is sent whole (replicated).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: ``(dim, start, stop)`` of a tensor.
Part = tuple[int, int, int]
DEFAULT_EXPERT_PATTERN = r"\.experts\.(?P<expert>\d+)\."


class TargetWeightLayout(BaseModel):
    """The part of the model one rollout rank holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    expert_ids: tuple[int, ...] | None = None
    expert_pattern: str = DEFAULT_EXPERT_PATTERN
    tp_rank: int = Field(0, ge=0)
    tp_size: int = Field(1, ge=1)
    tp_dims: dict[str, int] = Field(default_factory=dict)
    #: Tensor name -> ``(dim, start, stop)``: the part of it this rank holds.
    slices: dict[str, Part] = Field(default_factory=dict)

    @field_validator("expert_pattern")
    @classmethod
    def _expert_group(cls, value: str) -> str:
        try:
            compiled = re.compile(value)
        except re.error as exc:
            raise ValueError(f"expert_pattern {value!r} is not a regex: {exc}") from exc
        if "expert" not in compiled.groupindex:
            raise ValueError(f"expert_pattern {value!r} needs a named group (?P<expert>...)")
        return value

    @field_validator("tp_dims")
    @classmethod
    def _tp_patterns(cls, value: dict[str, int]) -> dict[str, int]:
        for pattern, dim in value.items():
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"tp_dims pattern {pattern!r} is not a regex: {exc}") from exc
            if dim < 0:
                raise ValueError(f"tp_dims[{pattern!r}] must be a dimension >= 0, got {dim}")
        return value

    @field_validator("slices")
    @classmethod
    def _slice_bounds(cls, value: dict[str, Part]) -> dict[str, Part]:
        for name, (dim, start, stop) in value.items():
            if dim < 0 or not 0 <= start <= stop:
                raise ValueError(
                    f"slices[{name!r}] = ({dim}, {start}, {stop}) needs dim >= 0 and "
                    "0 <= start <= stop"
                )
        return value

    @model_validator(mode="after")
    def _rank_in_range(self) -> TargetWeightLayout:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be < tp_size {self.tp_size}")
        return self

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (what ``get_target_weight_layout()`` returns)."""
        return self.model_dump(mode="json")


@dataclass(frozen=True, slots=True)
class Slice:
    """Send ``length`` entries of dimension ``dim`` starting at ``start``."""

    dim: int
    start: int
    length: int


WHOLE = Slice(dim=0, start=0, length=-1)


def _declared(name: str, shape: tuple[int, ...], part: Part) -> Slice:
    dim, start, stop = part
    if dim >= len(shape) or stop > shape[dim]:
        raise ValueError(
            f"tensor {name!r} with shape {shape} has no part [{start}, {stop}) on dimension "
            f"{dim}: the receiver declared a slice of another shape"
        )
    return Slice(dim=dim, start=start, length=stop - start)


def select_slice(
    name: str, shape: tuple[int, ...], layout: TargetWeightLayout | None
) -> Slice | None:
    """``None``: do not send ``name``; :data:`WHOLE`: send all; else the slice to send."""
    if layout is None:
        return WHOLE
    match = re.search(layout.expert_pattern, name)
    if match and layout.expert_ids is not None and int(match["expert"]) not in layout.expert_ids:
        return None
    if name in layout.slices:
        return _declared(name, shape, layout.slices[name])
    if layout.tp_size == 1:
        return WHOLE
    for pattern, dim in layout.tp_dims.items():
        if not re.search(pattern, name):
            continue
        if dim >= len(shape):
            raise ValueError(f"tensor {name!r} with shape {shape} has no dimension {dim} to split")
        if shape[dim] % layout.tp_size:
            raise ValueError(
                f"tensor {name!r} dimension {dim} (size {shape[dim]}) does not split into "
                f"{layout.tp_size} equal tensor-parallel parts"
            )
        part = shape[dim] // layout.tp_size
        return Slice(dim=dim, start=layout.tp_rank * part, length=part)
    return WHOLE
