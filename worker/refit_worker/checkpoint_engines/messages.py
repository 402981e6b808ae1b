"""Typed messages: rank metadata for the rendezvous and the engine's control protocol.

Everything here is JSON; nothing is pickled.  :class:`NixlAgentMetadata` is what
``prepare()`` returns and what the rendezvous store publishes per rank
(``model_dump_json()`` / ``model_validate_json()`` round-trip exactly); NIXL's own agent
blob travels base64-encoded, buffers as plain ``(addr, length, dev_id)`` records.

Control messages ride on NIXL notifications, framed as :data:`CONTROL_MAGIC` + JSON.  Each
carries the protocol version and the refit id; per-bucket ones a sequence number, so a late
notification of refit ``k-1`` can never be taken for refit ``k``:

* ``manifest`` (sender -> receiver): every tensor of the refit, optional checksums;
* ``bucket`` (sender -> receiver, as the notification of the WRITE that filled it);
  ``landed`` names the tensors whose chunks went to their landing memory, not the buffer;
* ``credit`` (receiver -> sender): buffer ``b`` may now receive bucket ``seq``; a source's
  first credit of a refit may offer ``landing`` memory for tensors larger than a bucket;
* ``done`` (receiver -> sender): the refit arrived complete and verified;
* ``abort`` (either way): the refit failed on the peer, with its reason.

Must not import: torch, nixl, the transport modules of this package.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    TypeAdapter,
    ValidationError,
)

from .base import TensorMeta

PROTOCOL_VERSION: Literal[1] = 1
CONTROL_MAGIC = b"RFT1"


def _b64decode(value: object) -> object:
    if isinstance(value, str):
        return base64.b64decode(value.encode("ascii"), validate=True)
    return value


B64Bytes = Annotated[
    bytes,
    BeforeValidator(_b64decode),
    PlainSerializer(lambda raw: base64.b64encode(raw).decode("ascii"), return_type=str),
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BufferDesc(_Model):
    """One registered receive buffer, as plain data."""

    addr: int = Field(ge=0)
    length: int = Field(ge=0)
    dev_id: int = Field(0, ge=0)


class NixlAgentMetadata(_Model):
    """What one rank publishes: enough for any peer to connect and write to it."""

    version: Literal[1] = PROTOCOL_VERSION
    agent_name: str = Field(min_length=1)
    agent_metadata: B64Bytes
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"
    buffers: tuple[BufferDesc, ...] = ()
    layout: dict[str, Any] | None = None


class _Control(_Model):
    v: Literal[1] = PROTOCOL_VERSION
    refit: int = Field(ge=0)


class ManifestEntry(_Model):
    """One tensor the receiver must end up with."""

    name: str = Field(min_length=1)
    dtype: str
    shape: tuple[int, ...]
    checksum: int | None = None


class Manifest(_Control):
    kind: Literal["manifest"] = "manifest"
    seq: Literal[0] = 0
    total_buckets: int = Field(ge=1)
    digest: str
    tensors: tuple[ManifestEntry, ...]


class BucketReady(_Control):
    kind: Literal["bucket"] = "bucket"
    seq: int = Field(ge=0)
    buffer: int = Field(ge=0)
    total_buckets: int = Field(ge=1)
    digest: str
    pieces: tuple[TensorMeta, ...]
    landed: tuple[str, ...] = ()


class Landing(_Model):
    """Registered memory where a sender may WRITE the chunks of one tensor in place.

    ``metadata`` is NIXL's partial agent metadata for that registration (its own binary
    format, as in :class:`NixlAgentMetadata`): the memory is registered after the peers
    loaded this rank's metadata, so they need it to WRITE there.
    """

    name: str = Field(min_length=1)
    nbytes: int = Field(gt=0)
    addr: int = Field(ge=0)
    dev_id: int = Field(0, ge=0)
    metadata: B64Bytes


class Credit(_Control):
    kind: Literal["credit"] = "credit"
    seq: int = Field(ge=0)
    buffer: int = Field(ge=0)
    landing: tuple[Landing, ...] = ()


class Done(_Control):
    kind: Literal["done"] = "done"
    seq: Literal[0] = 0


class Abort(_Control):
    kind: Literal["abort"] = "abort"
    seq: Literal[0] = 0
    reason: str


ControlMessage = Annotated[
    Manifest | BucketReady | Credit | Done | Abort, Field(discriminator="kind")
]
_ADAPTER: TypeAdapter[ControlMessage] = TypeAdapter(ControlMessage)


class ProtocolError(RuntimeError):
    """A peer sent a control message this version cannot accept."""


def encode(message: Manifest | BucketReady | Credit | Done | Abort) -> bytes:
    """Frame ``message`` for a NIXL notification."""
    return CONTROL_MAGIC + message.model_dump_json().encode()


def is_control(raw: bytes) -> bool:
    """Whether ``raw`` is framed as one of this protocol's control messages."""
    return raw.startswith(CONTROL_MAGIC)


def decode(raw: bytes) -> Manifest | BucketReady | Credit | Done | Abort:
    """Parse a framed control message; ``ProtocolError`` naming the problem otherwise."""
    if not is_control(raw):
        raise ProtocolError(f"not a control message (starts with {raw[:8]!r})")
    try:
        return _ADAPTER.validate_json(raw[len(CONTROL_MAGIC) :])
    except ValidationError as exc:
        raise ProtocolError(f"invalid control message: {exc}") from exc
