"""Rendezvous keys and the typed entries stored under them, with their JSON encoding.

Holds the key grammar (``meta.<role>.<rank>``, ``progress.<role>.<rank>``, ``barrier``,
``preempt``), the pydantic entry models (each with protocol version and epoch; per-rank
entries also with the writer's pod uid and generation; the barrier as the epoch's
membership), the size limits, and :func:`encode_entry` /
:func:`decode_entry`, whose every error is an :class:`EntryError` naming the key.
:mod:`refit_worker.contract.rendezvous` builds the coordinator's decisions on these.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from refit_worker.contract.roles import Role, check_role

#: 4: the rendezvous is split by role (``contract/shards.py``): the operator's map holds
#: only the barrier and the notice, each role writes only its own maps, so a worker of an
#: older release is refused by name instead of meeting 403s; a served version may name the
#: job key its seals passed.
#: 3: per-role failure domains (docs/failure-domains.md): rank entries carry the rollout
#: replica's generation, the barrier is the epoch's membership (rewritten, versioned), a
#: rank may report ``left``, and a preemption notice may name the role it stops.
#: (2 added recent refits and verification to progress; 1 had only the last refit.)
PROTOCOL_VERSION = 4

#: Ranks whose entries share one ConfigMap, cut by index (policy ranks, then rollout
#: ranks), so a scale-up never moves an existing rank's keys.  Sized so that a full
#: shard 0 (this many ranks at their metadata and progress limits, plus the membership of
#: MAX_RANKS ranks and the notice) stays under SHARD_BUDGET_BYTES;
#: ``tests/unit/test_rendezvous_protocol.py`` checks it.
RANKS_PER_SHARD = 100
#: Ranks (policy + rollout) one job may have: bounds the barrier value in shard 0.
MAX_RANKS = 4096
#: What one ConfigMap may hold of data, leaving room for metadata under the 1 MiB limit.
SHARD_BUDGET_BYTES = 1_000_000

#: Size limits of encoded values, by key kind.  NIXL agent metadata is ~451 bytes raw,
#: ~600 as base64 in JSON (a rollout rank's entry with its seed pointer: 1422 bytes
#: measured); the rest of the limit leaves room for buffer descriptors.  The two share
#: a rank's 6400 bytes of its shard: meta 5120 and progress 1280 until a rollout pod
#: reported the version it serves (issue #32); tests/unit/test_versions.py fills every
#: progress field to the most.
MAX_META_BYTES = 4864
MAX_PROGRESS_BYTES = 1536
#: Refits a progress entry itemises: a reader that samples at least once per this many
#: refits of a rank sees each of them; one that samples less sees the gap in the totals.
RECENT_REFITS = 8
MAX_PREEMPT_BYTES = 1024
#: Pod uids are 36 characters; local runs may use their own ids up to this length.
MAX_UID_CHARS = 40
#: Rollout generations a job may reach (bounds the membership's size in shard 0).
MAX_GENERATION = 999_999_999
_BARRIER_BASE_BYTES = 128
#: The most one membership slot takes: ``"<uid>",`` for a policy rank, and for a rollout
#: rank ``{"uid":"<uid>","generation":<9 digits>},`` plus its ``<9 digits>,`` in
#: ``generations``.
_BARRIER_SLOT_BYTES = len('{"uid":"","generation":},') + MAX_UID_CHARS + 9 + 10

BARRIER_KEY = "barrier"
PREEMPT_KEY = "preempt"

KeyKind: TypeAlias = Literal["meta", "progress", "barrier", "preempt"]
#: ``left``: a rollout rank removed by a scale-down at a refit boundary (it then exits 0).
ProgressState: TypeAlias = Literal["running", "done", "preempted", "failed", "left"]
#: How a rollout rank checked each refit before committing it, weakest first: nothing,
#: the manifest (every name, shape and dtype, every byte accounted for), integrity hashes
#: of every tensor, the serving engine's live layers read back after the landing (each
#: one's output through the engine's own kernels against the sent tensors), the serving
#: engine's greedy tokens for fixed prompts against the trainer's for the same weights
#: (after the landing), or every bit against independently regenerated weights.
Verification: TypeAlias = Literal[
    "none", "manifest", "checksums", "served-params", "tokens", "bit-exact"
]
VERIFICATION_ORDER: tuple[Verification, ...] = (
    "none",
    "manifest",
    "checksums",
    "served-params",
    "tokens",
    "bit-exact",
)

_KEY_RE = re.compile(r"(meta|progress)\.(policy|rollout)\.(0|[1-9][0-9]{0,8})")
_DATA_KEY_RE = re.compile(r"[-._a-zA-Z0-9]+")
_UID_RE = r"^[-._a-zA-Z0-9]{1,40}$"
#: What a pod uid (or a local run's stand-in id) may look like.
UID_PATTERN = re.compile(r"[-._a-zA-Z0-9]{1,40}")


class EntryError(ValueError):
    """A rendezvous value is garbage, tampered with or out of place; names the key."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"rendezvous key {key!r}: {reason}")
        self.key = key
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Key:
    """A parsed key: its kind and, for per-rank keys, the rank it belongs to."""

    kind: KeyKind
    role: Role | None = None
    rank: int | None = None

    @property
    def name(self) -> str:
        if self.role is None or self.rank is None:
            return self.kind
        return f"{self.kind}.{self.role}.{self.rank}"


def meta_key(role: Role, rank: int) -> str:
    """The key where rank ``rank`` of ``role`` publishes its NIXL agent metadata."""
    return Key("meta", check_role(role), _check_rank(rank)).name


def progress_key(role: Role, rank: int) -> str:
    """The key where rank ``rank`` of ``role`` reports its progress."""
    return Key("progress", check_role(role), _check_rank(rank)).name


def parse_key(key: str) -> Key | None:
    """The parsed key, or ``None`` for a key outside the protocol's grammar."""
    if key in (BARRIER_KEY, PREEMPT_KEY):
        return Key(key)  # type: ignore[arg-type]  # narrowed by the membership test
    match = _KEY_RE.fullmatch(key)
    if match is None:
        return None
    kind, role, rank = match.groups()
    return Key(kind, role, int(rank))  # type: ignore[arg-type]  # narrowed by the regex


def is_valid_data_key(key: str) -> bool:
    """Whether ``key`` may name an entry of a ConfigMap's ``data``."""
    return len(key) <= 253 and _DATA_KEY_RE.fullmatch(key) is not None


# -- entries -------------------------------------------------------------------------------


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    v: int = PROTOCOL_VERSION
    epoch: int = Field(ge=0)


class _RankEntry(_Entry):
    uid: str = Field(pattern=_UID_RE)
    role: Role
    rank: int = Field(ge=0)
    #: The rollout replica's generation (0 for policy ranks): a replacement pod of the
    #: same rank has a higher one, so its entries are told from the stale pod's.
    generation: int = Field(0, ge=0, le=MAX_GENERATION)


class SeedPointer(BaseModel):
    """Where a rollout rank offers its last committed refit to peers that seed from it: a
    registered region holding the seed manifest (:mod:`refit_worker.engine.rollout.seed_transfer`),
    and NIXL's partial metadata of that region (base64) so a peer can READ it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    addr: int = Field(ge=0)
    nbytes: int = Field(gt=0, le=1 << 30)
    dev_id: int = Field(0, ge=0)
    metadata: str = Field(min_length=1, max_length=3072)


class MetadataEntry(_RankEntry):
    """A rank's NIXL agent metadata: an opaque JSON text made by the NIXL engine; a rollout
    rank that committed a refit also says where peers may seed from it (``seed``)."""

    agent: str = Field(min_length=2)
    seed: SeedPointer | None = None

    @field_validator("agent")
    @classmethod
    def _agent_is_json(cls, value: str) -> str:
        try:
            json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"agent metadata is not JSON: {exc}") from exc
        return value


class RefitReport(BaseModel):
    """One refit as a rank reported it: what moved, and how long transfer and commit took."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    refit: int = Field(ge=0)
    bytes: int = Field(ge=0)
    seconds: float = Field(ge=0, allow_inf_nan=False)


#: Where a rollout pod's first committed refit came from: a peer (``rollout-<rank>``),
#: the pod it replaced, handing over (``rollout-<rank>-g<generation>``), or the policy.
_SEED_SOURCE_RE = r"^(policy|rollout-(0|[1-9][0-9]{0,8})(-g(0|[1-9][0-9]{0,8}))?)$"


#: A whole state's digest (``engine.messages.integrity.state_digest``): the hash
#: algorithm of the memory it is in, then 16 hex digits.
DIGEST_PATTERN = r"^(xxh3_64|wsum64):[0-9a-f]{16}$"


class ServedVersion(BaseModel):
    """The weights a rollout pod serves: the refit it committed last and the digest of
    that committed state, hashed from the bytes it serves (None: not hashed)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    refit: int = Field(ge=0)
    digest: str | None = Field(None, pattern=DIGEST_PATTERN)
    #: The job key whose seals this version passed on this pod (:mod:`~refit_worker.
    #: engine.messages.signing`); None: no signature was checked of it.
    signed_by: str | None = Field(None, pattern=r"^ed25519:[0-9a-f]{16}$")

    @property
    def label(self) -> str:
        """The weight version an engine tags its responses with: ``refit-<k>@<digest>``
        (``refit-<k>`` when the state was not hashed)."""
        return f"refit-{self.refit}@{self.digest}" if self.digest else f"refit-{self.refit}"


class SeedReport(BaseModel):
    """How a rollout pod came to serve: its first committed refit, who sent it
    (``rollout-<rank>``: seeded by a peer; ``policy``: the policy ranks' send), the bytes
    and transfer seconds of that refit, and the seconds from the pod's process start to
    that commit (serving the weights)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    source: str = Field(pattern=_SEED_SOURCE_RE)
    refit: int = Field(ge=0)
    bytes: int = Field(ge=0)
    seconds: float = Field(ge=0, allow_inf_nan=False)
    serving_s: float = Field(ge=0, allow_inf_nan=False)


class ProgressEntry(_RankEntry):
    """A rank's progress in its epoch; rollout ranks count what they committed.

    ``refits_completed`` counts from the job's start (a recreated gang resumes there);
    ``bytes_total`` and ``seconds_total`` cover the refits of this rank's pod (a rollout
    pod outlives policy epochs, and its totals carry on: the operator counts bytes per pod
    uid), of which ``recent`` itemises the last :data:`RECENT_REFITS`.
    """

    state: ProgressState = "running"
    #: Refits the job had committed when this epoch began (where this gang resumed).
    first_refit: int = Field(0, ge=0)
    refits_completed: int = Field(0, ge=0)
    bytes_total: int = Field(0, ge=0)
    seconds_total: float = Field(0.0, ge=0, allow_inf_nan=False)
    recent: tuple[RefitReport, ...] = Field((), max_length=RECENT_REFITS)
    verification: Verification = "none"
    message: str = Field("", max_length=200)
    #: A rollout pod's first commit: who sent it and when it began serving (None: not yet,
    #: or a policy rank).  A peer's seed is not in ``bytes_total`` or ``recent``: those
    #: count what the policy ranks sent.
    seed: SeedReport | None = None
    #: The rank stays after the last refit to serve late rollout members with it: a
    #: rollout pod seeds them (then the policy ranks need not stay), a policy rank sends.
    seeding: bool = False
    #: The version a rollout pod serves now (None: nothing committed, or a policy rank).
    serving: ServedVersion | None = None

    @property
    def last_refit(self) -> RefitReport | None:
        return self.recent[-1] if self.recent else None


class RolloutMember(BaseModel):
    """Who holds a rollout slot of the membership: the pod uid and its generation."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    uid: str = Field(pattern=_UID_RE)
    generation: int = Field(0, ge=0, le=MAX_GENERATION)


class BarrierEntry(_Entry):
    """The membership of ``epoch``, written by the coordinator alone.

    ``policy_uids`` lists the policy gang (every rank, fixed for the epoch); ``rollout``
    has one slot per rollout rank of the desired replica count R, ``None`` where no pod
    is a member now.  ``version`` goes up by one at each rewrite within the epoch (the
    first opening is version 1), so readers can tell a newer membership from an older.
    """

    version: int = Field(1, ge=1)
    policy_uids: tuple[Annotated[str, Field(pattern=_UID_RE)], ...] = Field(min_length=1)
    rollout: tuple[RolloutMember | None, ...] = Field(min_length=1)
    #: Per rollout slot, the generation of the pod the coordinator holds it for: the
    #: member's, or a replacement's still on its way (empty: not said).  A slot with no
    #: member whose last report is of an older generation is being replaced, so that
    #: report is no longer the slot's word on what it committed.
    generations: tuple[Annotated[int, Field(ge=0, le=MAX_GENERATION)], ...] = ()

    @model_validator(mode="after")
    def _within_max_ranks(self) -> BarrierEntry:
        if len(self.policy_uids) + len(self.rollout) > MAX_RANKS:
            raise ValueError(
                f"lists {len(self.policy_uids)} policy and {len(self.rollout)} rollout "
                f"ranks, over {MAX_RANKS}"
            )
        if self.generations and len(self.generations) != len(self.rollout):
            raise ValueError(
                f"generations has {len(self.generations)} values for "
                f"{len(self.rollout)} rollout slots"
            )
        return self

    def generation_of(self, rank: int) -> int:
        """The generation slot ``rank`` is held for (0 when the barrier does not say)."""
        return self.generations[rank] if rank < len(self.generations) else 0

    @property
    def policy_world_size(self) -> int:
        return len(self.policy_uids)

    @property
    def rollout_world_size(self) -> int:
        """R: the rollout ranks desired now (members or not)."""
        return len(self.rollout)

    def members(self) -> tuple[int, ...]:
        """The rollout ranks that have a member now, in rank order."""
        return tuple(rank for rank, slot in enumerate(self.rollout) if slot is not None)

    def holder(self, role: Role, rank: int) -> RolloutMember | None:
        """Who holds ``role`` rank ``rank`` (policy ranks: generation 0); None if nobody
        does or the rank is outside the membership."""
        if role == "policy":
            if 0 <= rank < len(self.policy_uids):
                return RolloutMember(uid=self.policy_uids[rank], generation=0)
            return None
        return self.rollout[rank] if 0 <= rank < len(self.rollout) else None

    def is_member(self, role: Role, rank: int, uid: str, generation: int = 0) -> bool:
        """Whether the pod ``uid`` of ``generation`` holds ``role`` rank ``rank`` now.

        A stale pod (an older generation, or another uid) of a rank is not a member, nor
        is a rank at or past the world sizes.  Policy ranks have generation 0.
        """
        held = self.holder(role, rank)
        return held is not None and (held.uid, held.generation) == (uid, generation)


class PreemptNotice(_Entry):
    """Every rank of ``epoch`` (``role`` None), or only its policy gang (``role``
    "policy": rollout ranks keep serving and rejoin the next epoch), stops at its next
    safe point."""

    pod: str = Field(min_length=1, max_length=253)
    uid: str = Field(pattern=_UID_RE)
    reason: str = Field(min_length=1, max_length=200)
    role: Literal["policy"] | None = None

    def stops(self, role: Role) -> bool:
        """Whether a rank of ``role`` (of the notice's epoch) must stop for it."""
        return self.role is None or self.role == role


Entry: TypeAlias = MetadataEntry | ProgressEntry | BarrierEntry | PreemptNotice
_MODELS: dict[KeyKind, type[_Entry]] = {
    "meta": MetadataEntry,
    "progress": ProgressEntry,
    "barrier": BarrierEntry,
    "preempt": PreemptNotice,
}


def max_value_bytes(kind: KeyKind) -> int:
    """The largest encoded value a key of ``kind`` may hold."""
    if kind == "barrier":
        return _BARRIER_BASE_BYTES + MAX_RANKS * _BARRIER_SLOT_BYTES
    return {"meta": MAX_META_BYTES, "progress": MAX_PROGRESS_BYTES}.get(kind, MAX_PREEMPT_BYTES)


def encode_entry(key: str, entry: Entry) -> str:
    """The compact JSON value of ``entry`` under ``key``; EntryError if it does not belong."""
    parsed = parse_known_key(key)
    if not isinstance(entry, _MODELS[parsed.kind]):
        raise EntryError(key, f"a {type(entry).__name__} cannot be stored under this key")
    _check_owner(key, parsed, entry)
    text = entry.model_dump_json()
    _check_size(key, parsed.kind, len(text.encode()))
    return text


class TruncatedValue(str):
    """The first bytes of a stored value too large to read whole, with its real size.

    A store that caps what it reads (the file store) hands this over, so the size check
    below quotes the value's real size, not the cap.
    """

    size: int

    def __new__(cls, head: str, size: int) -> TruncatedValue:
        value = super().__new__(cls, head)
        value.size = size
        return value


def _value_size(text: str) -> int:
    return text.size if isinstance(text, TruncatedValue) else len(text.encode())


def decode_entry(key: str, text: str) -> Entry:
    """The entry stored as ``text`` under ``key``; EntryError says what is wrong with it."""
    parsed = parse_known_key(key)
    _check_size(key, parsed.kind, _value_size(text))
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EntryError(key, f"value is not JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise EntryError(key, f"value is a JSON {type(raw).__name__}, not an object")
    version = raw.get("v")
    if version != PROTOCOL_VERSION:
        raise EntryError(
            key, f"protocol version {version!r}, this reader speaks {PROTOCOL_VERSION}"
        )
    model = _MODELS[parsed.kind]
    try:
        # From the text in JSON mode: strict there still takes arrays for tuples.
        entry: Entry = model.model_validate_json(text)  # type: ignore[assignment]
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}" for err in exc.errors()
        )
        raise EntryError(key, f"does not match the {parsed.kind} schema ({problems})") from exc
    _check_owner(key, parsed, entry)
    return entry


# -- checks -------------------------------------------------------------------------------


def _check_rank(rank: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank {rank!r} is not a non-negative int")
    return rank


def parse_known_key(key: str) -> Key:
    """The parsed key; EntryError if ``key`` is outside the grammar."""
    parsed = parse_key(key)
    if parsed is None:
        raise EntryError(
            key,
            "not a rendezvous key (expected meta.<role>.<rank>, "
            "progress.<role>.<rank>, barrier or preempt)",
        )
    return parsed


def _check_owner(key: str, parsed: Key, entry: Entry) -> None:
    if isinstance(entry, _RankEntry) and (entry.role, entry.rank) != (parsed.role, parsed.rank):
        raise EntryError(key, f"holds the entry of {entry.role} rank {entry.rank}")


def _check_size(key: str, kind: KeyKind, size: int) -> None:
    limit = max_value_bytes(kind)
    if size > limit:
        raise EntryError(key, f"value is {size} bytes, over the {limit}-byte limit")
