"""Typed messages: rank metadata for the rendezvous and the engine's control protocol.

Everything here is JSON; nothing is pickled.  :class:`NixlAgentMetadata` is what
``prepare()`` returns and what the rendezvous store publishes per rank
(``model_dump_json()`` / ``model_validate_json()`` round-trip exactly); NIXL's own agent
blob travels base64-encoded, buffers as plain ``(addr, length, dev_id)`` records.

Control messages ride on NIXL notifications, framed as :data:`CONTROL_MAGIC` + JSON.  Each
carries the protocol version and the refit id; per-bucket ones a sequence number, so a late
notification of refit ``k-1`` can never be taken for refit ``k``:

* ``manifest`` (sender -> receiver): every tensor of the refit, the bucket size and the
  integrity hash in use; the receiver plans the buckets itself from it (the plan is a pure
  function of the manifest, checked against the sender's ``digest``);
* ``ready`` (receiver -> sender): the manifest checked; ``landing`` names the registered
  memory the sender WRITEs tensors straight into (sent in full once per connection, then
  by id);
* ``credit`` (receiver -> sender): buffer ``b`` may now receive bucket ``seq``; only buckets
  with a piece that does not land in landing memory need one;
* ``bucket`` (sender -> receiver, as the notification of the WRITE that filled it);
* ``digest`` (sender -> receiver): the integrity hash of every piece of bucket ``seq``,
  computed off the transfer's thread and sent when ready;
* ``seal`` (sender -> receiver): the sender's Ed25519 signature over the manifest it sent
  and every piece hash it sent (:mod:`.signing`), once the last digest is out;
* ``done`` (receiver -> sender): the refit arrived complete and verified;
* ``abort`` (either way): the refit failed on the peer, with its reason;
* ``decline`` (receiver -> sender): this rank will not take refit ``k`` (an older refit
  than it waits for, or its sources disagree on the membership); the sender counts the
  target as not delivered, not as an error.  ``whole``: it will take refit ``k`` whole, not
  as the delta it was offered (it lacks the delta's base, or the delta's result failed the
  whole-state check); the sender owes it the whole refit.

A manifest's ``delta`` (:class:`DeltaHeader`) says the refit is a delta: one ``uint8``
tensor of changed elements (:mod:`refit_worker.engine.delta.codec`) to apply onto the version
``base_refit`` /
``base_digest`` the receiver serves, whose result must have the whole-state ``digest``.

A manifest carries the sender's membership ``version`` and rollout world size, so that a
receiver with several sources takes a refit only when they all planned it from the same
membership (:mod:`refit_worker.engine.transport.peers`).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
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

PROTOCOL_VERSION: Literal[1] = 1
#: Version of the control messages.  6: ``seal`` (signed refits), a manifest's
#: ``sealed_by``.  5: a manifest may carry a ``delta``; a decline may ask for the ``whole``
#: refit.  4: every source sends a manifest carrying the
#: membership ``version`` and ``rollout_world_size``; ``decline``.  3: manifest entries may
#: carry the source boxes of a sharded tensor (``sources``) and the destination's place in
#: it (``offset``).  2: the receiver plans from the manifest and answers ``ready`` with its
#: landing memory; per-piece integrity digests (1 had credits with ``landing``, pieces in
#: every ``bucket`` and per-tensor CRCs in the manifest).  A peer of another version is
#: refused by name.
CONTROL_VERSION: Literal[6] = 6
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


MetadataLike = NixlAgentMetadata | str | dict[str, Any]


def parse_metadata(
    metadata: Sequence[MetadataLike | None], expected: int
) -> list[NixlAgentMetadata | None]:
    """Validate the all-ranks metadata listing (policy ranks, then rollout ranks); ``None``
    stands for a rank that is absent now (no member in its slot)."""
    if isinstance(metadata, str | bytes) or len(metadata) != expected:
        got = "a string" if isinstance(metadata, str | bytes) else f"{len(metadata)} entries"
        raise ValueError(
            f"metadata must list {expected} ranks (policy ranks, then rollout ranks), got {got}"
        )
    parsed: list[NixlAgentMetadata | None] = []
    for index, item in enumerate(metadata):
        if item is None or isinstance(item, NixlAgentMetadata):
            parsed.append(item)
        elif isinstance(item, str):
            parsed.append(NixlAgentMetadata.model_validate_json(item))
        elif isinstance(item, dict):
            parsed.append(NixlAgentMetadata.model_validate(item))
        else:
            raise TypeError(f"metadata[{index}] is a {type(item).__name__}, not NixlAgentMetadata")
    names = [m.agent_name for m in parsed if m is not None]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"metadata names agent(s) {twice} for more than one rank")
    return parsed


class _Control(_Model):
    v: Literal[6] = CONTROL_VERSION
    refit: int = Field(ge=0)


class SourceBox(_Model):
    """A block of a sharded tensor (global coordinates) that one policy rank sends."""

    rank: int = Field(ge=0)
    offset: tuple[Annotated[int, Field(ge=0)], ...]
    size: tuple[Annotated[int, Field(ge=0)], ...]


class ManifestEntry(_Model):
    """One tensor the receiver must end up with.

    A sharded tensor also lists its ``sources`` (each block sent by one policy rank) and
    where the receiver's tensor (``shape``) sits in the global tensor (``offset``; zeros by
    default); without ``sources`` every sender holds the whole tensor.
    """

    name: str = Field(min_length=1)
    dtype: str
    shape: tuple[int, ...]
    offset: tuple[Annotated[int, Field(ge=0)], ...] | None = None
    sources: tuple[SourceBox, ...] | None = None


class BlockRef(_Model):
    """A block of a tensor of global ``shape``: ``size[d]`` entries from ``offset[d]``."""

    shape: tuple[Annotated[int, Field(ge=0)], ...]
    offset: tuple[Annotated[int, Field(ge=0)], ...]
    size: tuple[Annotated[int, Field(ge=0)], ...]


class BlockHash(_Model):
    """The integrity hash of one block of a tensor (a sharded delta's whole-state check)."""

    name: str = Field(min_length=1)
    dtype: str
    block: BlockRef
    hash: int = Field(ge=0, lt=2**64)


class DeltaEntry(_Model):
    """The changed elements of one tensor inside a delta's bytes: ``count`` flat indices
    (``index_dtype``, ascending) at byte ``offset``, then their new values (the tensor's
    ``dtype``) at byte ``values_offset``.

    From a sharded sender (``block`` set) the entry covers one block of the tensor: the
    indices are flat within the block, ``numel`` is the block's, and a tensor may have one
    entry per block."""

    name: str = Field(min_length=1)
    dtype: str
    numel: int = Field(ge=0)
    count: int = Field(ge=1)
    index_dtype: Literal["int32", "int64"]
    offset: int = Field(ge=0)
    values_offset: int = Field(ge=0)
    block: BlockRef | None = None


class DeltaHeader(_Model):
    """A refit sent as the changes since the version ``base_refit`` (whole-state digest
    ``base_digest``); applied to it, it must give the whole-state ``digest``."""

    base_refit: int = Field(ge=0)
    base_digest: str = Field(min_length=1, max_length=64)
    digest: str = Field(min_length=1, max_length=64)
    #: Bytes of the delta tensor; tensors without a change are not listed.
    nbytes: int = Field(ge=0)
    entries: tuple[DeltaEntry, ...]
    #: From sharded senders: every block's hash, of which ``digest`` is the digest (no
    #: sender holds a whole tensor); the receiver hashes the same blocks of its result.
    blocks: tuple[BlockHash, ...] | None = None


class Manifest(_Control):
    kind: Literal["manifest"] = "manifest"
    seq: Literal[0] = 0
    total_buckets: int = Field(ge=1)
    digest: str
    bucket_size: int = Field(gt=0)
    #: Hash every piece is checked with before the refit is accepted; None: no check.
    integrity: Literal["xxh3_64", "wsum64"] | None = None
    tensors: tuple[ManifestEntry, ...]
    #: The membership version the sender planned this refit from (see
    #: :mod:`refit_worker.engine.transport.peers`).
    version: int = Field(0, ge=0)
    #: The rollout world size it planned with; None: the receiver's own.
    rollout_world_size: int | None = Field(None, ge=1)
    #: The sender's connection to this receiver (see ``Routes.connection``); None: unnamed.
    connection: str | None = Field(None, min_length=1, max_length=64)
    #: The refit is a delta onto a version the receiver serves (see :class:`DeltaHeader`);
    #: ``tensors`` then lists the one tensor of its bytes.
    delta: DeltaHeader | None = None
    #: The fingerprint of the key whose ``seal`` follows the digests; None: unsigned.
    sealed_by: str | None = Field(None, min_length=1, max_length=64)


class BucketReady(_Control):
    kind: Literal["bucket"] = "bucket"
    seq: int = Field(ge=0)
    #: The receive buffer the bucket's non-landing pieces went to; -1: none (all landed).
    buffer: int = Field(ge=-1)
    digest: str


class LandingTensor(_Model):
    """Registered memory where a sender WRITEs every byte of one tensor in place."""

    name: str = Field(min_length=1)
    nbytes: int = Field(gt=0)
    addr: int = Field(ge=0)
    dev_id: int = Field(0, ge=0)


class LandingRegion(_Model):
    """One registration behind a landing set: its memory and which registration it is.

    A sender that loaded NIXL metadata of a region keeps it until it forgets the peer (NIXL
    cannot drop one region of a peer), so it must know when the receiver deregistered that
    memory and registered it (or memory around it) again: a new ``registration``, or a
    region that overlaps an old one without being it."""

    addr: int = Field(ge=0)
    nbytes: int = Field(gt=0)
    dev_id: int = Field(0, ge=0)
    registration: int = Field(ge=0)


class LandingSet(_Model):
    """Landing memory for a set of tensors, as plain data.

    ``metadata`` is NIXL's partial agent metadata for the registrations behind it (its own
    binary format, as in :class:`NixlAgentMetadata`): the memory may be registered after the
    peers loaded this rank's metadata, so they need it to WRITE there.  ``id`` names the set
    so that it crosses the network once per connection.
    """

    id: str = Field(min_length=1)
    metadata: B64Bytes
    tensors: tuple[LandingTensor, ...]
    #: The registrations ``metadata`` describes (empty from a receiver that does not say).
    regions: tuple[LandingRegion, ...] = ()


class Ready(_Control):
    kind: Literal["ready"] = "ready"
    seq: Literal[0] = 0
    #: The landing set in full (first use on this connection) ...
    landing: LandingSet | None = None
    #: ... or the id of one sent earlier on this connection; both None: nothing lands.
    landing_id: str | None = None


class Credit(_Control):
    kind: Literal["credit"] = "credit"
    seq: int = Field(ge=0)
    buffer: int = Field(ge=0)


class Digest(_Control):
    kind: Literal["digest"] = "digest"
    seq: int = Field(ge=0)
    #: One hash per piece of bucket ``seq``, in plan order.
    hashes: tuple[int, ...]


class Seal(_Control):
    kind: Literal["seal"] = "seal"
    seq: Literal[0] = 0
    #: Ed25519 over :func:`~.signing.seal_payload` of this sender's manifest and digests.
    signature: B64Bytes = Field(min_length=64, max_length=64)
    #: The fingerprint of the key it claims (a mismatch is named, not trusted).
    key: str = Field(min_length=1, max_length=64)


class Done(_Control):
    kind: Literal["done"] = "done"
    seq: Literal[0] = 0


class Abort(_Control):
    kind: Literal["abort"] = "abort"
    seq: Literal[0] = 0
    reason: str


class Decline(_Control):
    kind: Literal["decline"] = "decline"
    seq: Literal[0] = 0
    reason: str
    #: The receiver still wants this refit, whole (it could not use the delta offered).
    whole: bool = False


Message = Manifest | Ready | BucketReady | Credit | Digest | Seal | Done | Abort | Decline
ControlMessage = Annotated[Message, Field(discriminator="kind")]
_ADAPTER: TypeAdapter[ControlMessage] = TypeAdapter(ControlMessage)


class ProtocolError(RuntimeError):
    """A peer sent a control message this version cannot accept."""


def encode(message: Message) -> bytes:
    """Frame ``message`` for a NIXL notification."""
    return CONTROL_MAGIC + message.model_dump_json().encode()


def is_control(raw: bytes) -> bool:
    """Whether ``raw`` is framed as one of this protocol's control messages."""
    return raw.startswith(CONTROL_MAGIC)


def decode(raw: bytes) -> Message:
    """Parse a framed control message; ``ProtocolError`` naming the problem otherwise."""
    if not is_control(raw):
        raise ProtocolError(f"not a control message (starts with {raw[:8]!r})")
    body = raw[len(CONTROL_MAGIC) :]
    try:
        return _ADAPTER.validate_json(body)
    except ValidationError as exc:
        version = _version(body)
        if version is not None and version != CONTROL_VERSION:
            raise ProtocolError(
                f"invalid control message: protocol version {version}, this worker speaks "
                f"version {CONTROL_VERSION}; run the same kube-refit release on both sides"
            ) from exc
        raise ProtocolError(f"invalid control message: {exc}") from exc


def _version(body: bytes) -> object:
    """The ``v`` field of a JSON object, if it is one (to name the peer's version)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed.get("v") if isinstance(parsed, dict) else None
