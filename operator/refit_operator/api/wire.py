"""The base of every RefitJob spec model: camelCase on the wire, strict, frozen.

Pure.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

#: Every wire model's config.  No inf/nan: JSON, and so the API server, cannot carry them.
WIRE = ConfigDict(
    extra="forbid",
    frozen=True,
    alias_generator=to_camel,
    populate_by_name=True,
    allow_inf_nan=False,
)


class Wire(BaseModel):
    model_config = WIRE
