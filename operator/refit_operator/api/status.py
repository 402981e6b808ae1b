"""The ``RefitJob`` status: phase, conditions (``metav1.Condition``) and figures.

Written only by the operator; the CRD's status schema is generated from these models
(``crd.py``), so the apiserver refuses a status that breaks them.  ``models.py``
re-exports every name here.

Pure.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

#: ``metav1.Condition``'s rules: a CamelCase reason is required, a qualified-name type.
CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
CONDITION_TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
CONDITION_MESSAGE_MAX = 32768


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
    """One condition, as metav1.Condition: a reason always, the generation it saw."""

    type: str = Field(max_length=316, pattern=CONDITION_TYPE_PATTERN)
    status: Literal["True", "False", "Unknown"]
    observed_generation: int = Field(0, ge=0)
    last_transition_time: datetime
    reason: str = Field(min_length=1, max_length=1024, pattern=CONDITION_REASON_PATTERN)
    message: str = Field("", max_length=CONDITION_MESSAGE_MAX)


class RoleStatus(_Status):
    """One role's pods: Ready, existing (of the current epoch or generation) and asked."""

    ready: int = 0
    total: int = 0
    desired: int = 0
    #: Rollout: replicas replaced alone (after a failure or a disruption); policy: 0.
    replacements: int = 0


class RolloutReplica(_Status):
    """One rollout slot (rank): its current generation and pod, and what it committed."""

    rank: int = Field(ge=0)
    generation: int = Field(0, ge=0)
    #: The pod of this generation once created ('' until then).
    pod: str = ""
    last_committed_refit: int = 0
    ready: bool = False
    #: Failures of this rank in a row (its replacement backoff doubles per one).
    failures: int = Field(0, ge=0)
    #: Not before this time is the replacement's pod created.
    replace_at: datetime | None = None
    #: How the current pod came to serve, from its progress report's seed (all None until
    #: its first commit): who sent that refit, ``rollout-<rank>`` (a peer seeded it),
    #: ``rollout-<rank>-g<generation>`` (the pod it replaced, handing over on a drain) or
    #: ``policy`` (the policy ranks' send).
    seeded_from: str | None = None
    #: That first committed refit: its id, bytes and transfer seconds.
    seeded_refit: int | None = Field(None, ge=0)
    seeded_bytes: int | None = Field(None, ge=0)
    seeded_seconds: float | None = Field(None, ge=0)
    #: Seconds from the pod's process start to that commit (serving the weights).
    seconds_to_serving: float | None = Field(None, ge=0)


#: A replica's seed fields cleared: its slot moved to a new pod, which has not committed.
UNSEEDED: dict[str, Any] = dict.fromkeys(
    ("seeded_from", "seeded_refit", "seeded_bytes", "seeded_seconds", "seconds_to_serving")
)


def seed_kind(replica: RolloutReplica) -> Literal["peer", "policy"] | None:
    """Whether the replica's pod was seeded by a rollout peer or by the policy's send."""
    if replica.seeded_from is None:
        return None
    return "policy" if replica.seeded_from == "policy" else "peer"


def seed_words(replica: RolloutReplica) -> str | None:
    """How the replica's pod came to serve, in words (None: it has not committed yet);
    the ReplicaSeeded Event and ``refit run`` say it the same way."""
    if replica.seeded_from is None:
        return None
    return (
        f"{first_refit_source(replica.seeded_from)}: refit {replica.seeded_refit}, "
        f"{decimal_bytes(replica.seeded_bytes or 0)} in {replica.seeded_seconds or 0.0:.3f} s, "
        f"serving {replica.seconds_to_serving or 0.0:.1f} s after its start"
    )


def first_refit_source(seeded_from: str) -> str:
    """Where a pod's first refit came from: a peer seeds one; the policy sends one (no
    seeding took place, so the words do not say so)."""
    if seeded_from == "policy":
        return "took its first refit from the policy"
    return f"seeded from {seeded_from}"


def decimal_bytes(n: int) -> str:
    """Bytes in the decimal unit that shows their digits (a tiny test model is no '0.0 MB')."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class ServedVersionRow(_Status):
    """One row of the versions ledger: a refit, the digest of its whole state as the
    replicas serving it hashed it, and those replicas (rollout ranks)."""

    refit: int = Field(ge=0)
    #: ``<algorithm>:<16 hex digits>``; None where the replicas reported no digest.
    digest: str | None = None
    replicas: list[int] = Field(default_factory=list)
    #: ``ed25519:<16 hex digits>``: the job key whose seals these replicas checked this
    #: version against; None: they checked no signature of it (unsigned, or seeded).
    signed_by: str | None = None


#: What one rollout rank reports serving: (refit, digest, the key its seals passed).
Served = tuple[int, str | None, str | None]


def version_ledger(served: dict[int, Served]) -> list[ServedVersionRow]:
    """The ledger from what each rollout rank serves (rank -> (refit, digest, key)): one
    row per distinct triple, newest refit first, its ranks in order.  Two rows of one refit
    and digest differ in what was checked of it; two digests of one refit mean replicas
    serving different bytes under the same version."""
    rows: dict[Served, list[int]] = {}
    for rank in sorted(served):
        rows.setdefault(served[rank], []).append(rank)
    order = sorted(rows, key=lambda key: (-key[0], key[1] or "", key[2] or ""))
    return [
        ServedVersionRow(refit=r, digest=d, signed_by=k, replicas=rows[(r, d, k)])
        for r, d, k in order
    ]


def version_conflicts(ledger: list[ServedVersionRow]) -> list[int]:
    """Refits that two or more replicas serve with different digests."""
    digests: dict[int, set[str]] = {}
    for row in ledger:
        if row.digest is not None:
            digests.setdefault(row.refit, set()).add(row.digest)
    return sorted(refit for refit, seen in digests.items() if len(seen) > 1)


def version_words(ledger: list[ServedVersionRow]) -> list[str]:
    """``refit 3 xxh3_64:0123456789abcdef served by rollout-0, rollout-1``, per row."""
    return [
        f"refit {row.refit} {row.digest or '(no digest)'}"
        + (f" signed {row.signed_by}" if row.signed_by else "")
        + " served by "
        + ", ".join(f"rollout-{rank}" for rank in row.replicas)
        for row in ledger
    ]


class PodBytes(_Status):
    """The bytes one rollout pod (by uid) reported receiving, the most it ever reported."""

    uid: str = Field(min_length=1, max_length=128)
    bytes: int = Field(0, ge=0)


#: ``conditions`` is a list-map keyed by type, as in every built-in status.
_CONDITIONS_SCHEMA: dict[str, Any] = {
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["type"],
}


class RefitJobStatus(_Status):
    """The observed state of a RefitJob, written only by the operator."""

    phase: Phase = Phase.PENDING
    message: str = ""
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra=_CONDITIONS_SCHEMA)
    observed_generation: int = 0
    epoch: int = 0
    #: The epoch whose pods have all been created (None: not yet for the current epoch).
    created_epoch: int | None = None
    #: When the first pod of the current epoch was created: the start deadline counts
    #: from here.
    epoch_start_time: datetime | None = None
    #: The epoch whose gang was once all Ready: the start deadline no longer applies.
    ready_epoch: int | None = None
    #: Not before this time is the gang of the current epoch (re)created.
    restart_at: datetime | None = None
    policy: RoleStatus = Field(default_factory=RoleStatus)
    rollout: RoleStatus = Field(default_factory=RoleStatus)
    #: One entry per rollout rank of the desired replica count, in rank order.
    rollout_replicas: list[RolloutReplica] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["rank"]},
    )
    #: The versions the rollout replicas serve now (:func:`version_ledger`): what each
    #: replica's pod reported serving, grouped by refit and whole-state digest.
    versions: list[ServedVersionRow] = Field(default_factory=list)
    #: The rollout pods' label selector (the scale subresource's labelSelectorPath).
    rollout_selector: str = ""
    #: Rollout replacements after a failure (``rollout.failurePolicy.maxReplacements``).
    rollout_failures: int = 0
    restarts: int = 0
    preemptions: int = 0
    refits_completed: int = 0
    #: Bytes the rollout ranks reported receiving, over every pod the job ever had: the
    #: sum of ``bytesCounted`` (so it never goes down when a pod or its report goes away).
    bytes_transferred: int = 0
    #: Each rollout pod's own count (``core/progress.py:count_bytes``): a replaced, retired
    #: or restarted pod's bytes stay counted, and a pod seen twice counts once.
    bytes_counted: list[PodBytes] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["uid"]},
    )
    #: How every committed refit was checked, as the rollout ranks reported: "bit-exact",
    #: "tokens", "served-params", "checksums", "manifest" or "none" (the weakest any rank applied).
    verification: str = "none"
    last_throughput_bytes_per_second: float | None = None
    #: When the job first started (reset by a suspend, as a Job's): activeDeadlineSeconds
    #: counts from here.
    start_time: datetime | None = None
    completion_time: datetime | None = None


def parse_status(raw: Any) -> RefitJobStatus:
    """Read a stored status; an unreadable one counts as empty (the operator rewrites it)."""
    if not isinstance(raw, dict):
        return RefitJobStatus()
    try:
        return RefitJobStatus.model_validate(raw)
    except ValidationError:
        return RefitJobStatus()
