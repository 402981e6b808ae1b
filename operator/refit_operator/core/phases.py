"""The RefitJob phase machine: which phase follows from the facts, and which moves are legal.

A reconcile round's decision ends with an :class:`Outcome`; :func:`phase_of` maps it to
the phase through the :class:`PhaseFacts` it stands for (:func:`facts_of`, built once per
round), and every phase comes from :func:`next_phase`: an invalid spec (``invalid``) and
the retry once a Failed job's spec is fixed (``retry_invalid``) included.

Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from refit_operator.api.models import Phase

#: Legal moves.  Succeeded is final; Failed is left only when a user fixes an invalid spec
#: (a new generation: ``retry_invalid``).
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.PENDING: frozenset(
        {Phase.RUNNING, Phase.RESTARTING, Phase.SUSPENDED, Phase.SUCCEEDED, Phase.FAILED}
    ),
    Phase.RUNNING: frozenset(
        {Phase.PENDING, Phase.RESTARTING, Phase.SUSPENDED, Phase.SUCCEEDED, Phase.FAILED}
    ),
    Phase.RESTARTING: frozenset({Phase.PENDING, Phase.SUSPENDED, Phase.FAILED}),
    Phase.SUSPENDED: frozenset({Phase.PENDING, Phase.RESTARTING, Phase.FAILED}),
    Phase.SUCCEEDED: frozenset(),
    # Only for a corrected invalid spec (``retry_invalid``): the job starts over as if new.
    Phase.FAILED: frozenset({Phase.PENDING, Phase.RUNNING, Phase.RESTARTING, Phase.SUSPENDED}),
}

#: Phases in which a gang exists that can be ready or finished.
_ACTIVE = frozenset({Phase.PENDING, Phase.RUNNING, Phase.FAILED})


@dataclass(frozen=True, kw_only=True)
class PhaseFacts:
    """What the reconcile learnt this round, reduced to what decides the phase."""

    current: Phase
    invalid: bool = False
    retry_invalid: bool = False  # the spec changed since it was found invalid
    restarts_exhausted: bool = False
    not_retryable: bool = False  # a pod failed in a way no restart can cure
    deadline_exceeded: bool = False  # activeDeadlineSeconds ran out
    suspended: bool = False
    all_rollouts_done: bool = False
    gang_disrupted: bool = False  # a pod of the current epoch failed or was preempted
    waiting_for_gang: bool = False  # epoch bumped, old pods or backoff still pending
    all_ready: bool = False


class Outcome(StrEnum):
    """How a round's decision ended: what the policy (or the last step) that ended it
    found.  Each stands for one fact of :class:`PhaseFacts` (:func:`facts_of`), and so
    for a phase (:func:`phase_of`); ``SETTLED`` (a finished job stays finished) and
    ``NOT_READY`` (the gang runs, not all of it Ready) for none.  Compared by value, so
    the plain string of a member stands for it too."""

    SETTLED = "settled"
    SUSPENDED = "suspended"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    RESTARTS_EXHAUSTED = "restarts_exhausted"
    NOT_RETRYABLE = "not_retryable"
    ALL_ROLLOUTS_DONE = "all_rollouts_done"
    GANG_DISRUPTED = "gang_disrupted"
    WAITING_FOR_GANG = "waiting_for_gang"
    ALL_READY = "all_ready"
    NOT_READY = "not_ready"


def facts_of(outcome: Outcome, *, current: Phase, retry_invalid: bool = False) -> PhaseFacts:
    """The facts a round's outcome stands for (``SETTLED`` and ``NOT_READY``: none)."""
    return PhaseFacts(
        current=current,
        retry_invalid=retry_invalid,
        restarts_exhausted=outcome == Outcome.RESTARTS_EXHAUSTED,
        not_retryable=outcome == Outcome.NOT_RETRYABLE,
        deadline_exceeded=outcome == Outcome.DEADLINE_EXCEEDED,
        suspended=outcome == Outcome.SUSPENDED,
        all_rollouts_done=outcome == Outcome.ALL_ROLLOUTS_DONE,
        gang_disrupted=outcome == Outcome.GANG_DISRUPTED,
        waiting_for_gang=outcome == Outcome.WAITING_FOR_GANG,
        all_ready=outcome == Outcome.ALL_READY,
    )


def phase_of(outcome: Outcome, *, current: Phase, retry_invalid: bool = False) -> Phase:
    """The phase a round that ended with ``outcome`` moves the job to, from ``current``
    (``retry_invalid``: the spec was fixed since it was found invalid)."""
    return checked_next_phase(facts_of(outcome, current=current, retry_invalid=retry_invalid))


def next_phase(facts: PhaseFacts) -> Phase:
    """The phase the job moves to; rules are checked in priority order."""
    if facts.current is Phase.SUCCEEDED:
        return Phase.SUCCEEDED
    if facts.current is Phase.FAILED and not facts.retry_invalid:
        return Phase.FAILED
    if facts.invalid or facts.restarts_exhausted or facts.not_retryable:
        return Phase.FAILED
    if facts.deadline_exceeded:
        return Phase.FAILED
    if facts.suspended:
        return Phase.SUSPENDED
    if facts.all_rollouts_done and facts.current in (Phase.PENDING, Phase.RUNNING):
        return Phase.SUCCEEDED
    if facts.gang_disrupted or facts.waiting_for_gang:
        return Phase.RESTARTING
    if facts.all_ready and facts.current in _ACTIVE:
        return Phase.RUNNING
    return Phase.PENDING


def is_legal(old: Phase, new: Phase) -> bool:
    return old == new or new in TRANSITIONS[old]


def checked_next_phase(facts: PhaseFacts) -> Phase:
    """:func:`next_phase`, refusing a move the table does not allow (a bug in the rules,
    not in the input)."""
    new = next_phase(facts)
    if not is_legal(facts.current, new):
        raise RuntimeError(f"illegal phase move {facts.current} -> {new}")
    return new
