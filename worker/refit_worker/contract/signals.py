"""The signal vocabulary: one table of names and one parser for every place a signal is named.

A RefitJob names its preemption signal; the CRD checks the spelling, the models validate it,
the renderer puts it into the pod (``lifecycle.stopSignal`` and ``REFIT_PREEMPTION_SIGNAL``),
``WorkerConfig.from_env`` reads it back, ``DistributedSignalHandler`` listens for it,
``refit-signal`` and the process kubelet send it.  All of them read it through here:

- :func:`signal_from_name` — a name, any case, with or without ``SIG``, ASCII only;
- :func:`resolve_signal` — that, or a number (``15``, ``"15"``), or a ``signal.Signals``;
- :func:`check_catchable` — :data:`UNCATCHABLE` signals cannot announce anything;
- :func:`parse_signals` — one or several → a tuple: empty, repeated, uncatchable refused;
- :func:`parse_signal_list` / :func:`signal_list_text` — the comma-separated env form;
- :func:`canonical_name` — the name as Kubernetes writes it (``usr1`` → ``SIGUSR1``);
- :data:`SIGNAL_PATTERN`, :data:`KUBELET_STOP_SIGNALS` — the same table as the CRD sees it.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

SignalLike = int | str | signal.Signals

#: Every name this platform knows, aliases included (SIGIOT, SIGCLD...): the one table.
_BY_NAME: dict[str, signal.Signals] = dict(signal.Signals.__members__)

#: Signals a process cannot catch, so cannot listen for.
UNCATCHABLE: frozenset[signal.Signals] = frozenset({signal.SIGKILL, signal.SIGSTOP})

#: Names the kubelet accepts in ``lifecycle.stopSignal`` on Linux: the catchable ones
#: (real-time signals only by number there).
KUBELET_STOP_SIGNALS: tuple[str, ...] = tuple(
    sorted(
        s.name
        for s in signal.Signals
        if s not in UNCATCHABLE and s not in (signal.SIGRTMIN, signal.SIGRTMAX)
    )
)


def _any_case(text: str) -> str:
    # Letter by letter, not (?i): RE2's case folding also maps non-ASCII letters (U+017F).
    return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in text)


#: Every spelling :func:`canonical_name` accepts, as a pattern the CRD (RE2) can check.
SIGNAL_PATTERN = (
    f"^({_any_case('SIG')})?("
    + "|".join(_any_case(n[3:]) for n, s in sorted(_BY_NAME.items()) if s not in UNCATCHABLE)
    + ")$"
)


def signal_from_name(name: str) -> signal.Signals:
    """``"SIGTERM"``, ``"term"``, ``" Term "`` → ``signal.SIGTERM``; names only.

    ASCII only: ``str.upper`` would turn non-ASCII look-alikes (U+017F) into a name.
    ``ValueError`` names the value when it names no signal on this platform.
    """
    key = name.strip().upper()
    if not key.startswith("SIG"):
        key = "SIG" + key
    member = _BY_NAME.get(key) if name.isascii() else None
    if member is None:
        raise ValueError(f"Unknown signal name {name!r}")
    return member


def resolve_signal(sig: SignalLike) -> signal.Signals:
    """Turn ``15``, ``signal.SIGTERM``, ``"SIGTERM"``, ``" term "``, ``"15"`` into ``SIGTERM``.

    Names as :func:`signal_from_name`; decimal strings count as numbers (so a signal can be
    configured from YAML or env either way).  Raises ``TypeError`` for other types (``bool``
    included: ``True`` is no signal) and ``ValueError`` naming the value when it names no
    signal on this platform.
    """
    if isinstance(sig, signal.Signals):
        return sig
    if isinstance(sig, bool) or not isinstance(sig, int | str):
        raise TypeError(
            f"a signal must be an int, a str or a signal.Signals, not {type(sig).__name__}"
            f" ({sig!r})"
        )
    if isinstance(sig, str):
        text = sig.strip()
        if text.isascii() and text.isdecimal():
            return _signal_from_number(int(text), sig)
        return signal_from_name(sig)
    return _signal_from_number(sig, sig)


def _signal_from_number(number: int, given: SignalLike) -> signal.Signals:
    try:
        return signal.Signals(number)
    except ValueError:
        raise ValueError(
            f"Invalid signal number {given!r}: no signal has it on this platform"
        ) from None


def check_catchable(sig: signal.Signals, given: object) -> signal.Signals:
    """``sig``, unless it cannot be caught (``ValueError`` naming ``given``, as written)."""
    if sig in UNCATCHABLE:
        raise ValueError(f"signal {given!r} cannot be caught, so it cannot announce a preemption")
    return sig


def canonical_name(name: str) -> str:
    """``'usr1'``, ``'sigusr1'`` → ``'SIGUSR1'``; ValueError if unknown or uncatchable."""
    return check_catchable(signal_from_name(name), name).name


def parse_signals(
    sig: SignalLike | Sequence[SignalLike], *, given: object = None
) -> tuple[signal.Signals, ...]:
    """One signal or a sequence of them → a tuple, in order.

    Refuses an empty sequence, a signal named twice and one that cannot be caught, each with
    a ``ValueError`` that names ``given`` (default: ``sig``); a wrong type is a TypeError.
    """
    shown = sig if given is None else given
    many: Sequence[SignalLike] = [sig] if isinstance(sig, int | str | signal.Signals) else sig
    if not isinstance(many, Sequence):
        raise TypeError(
            f"sig must be a signal or a sequence of signals, not {type(sig).__name__} ({sig!r})"
        )
    signals = tuple(check_catchable(resolve_signal(one), one) for one in many)
    if not signals:
        raise ValueError(f"At least one signal must be named; {shown!r} is an empty sequence")
    repeated = sorted({s.name for s in signals if signals.count(s) > 1})
    if repeated:
        raise ValueError(
            f"Duplicate signals: {', '.join(repeated)} given more than once in {shown!r}"
        )
    return signals


def parse_signal_list(text: str) -> tuple[signal.Signals, ...]:
    """Parse ``"SIGTERM, usr1"`` (the env and ``--signal`` form) as :func:`parse_signals`."""
    parts = text.split(",")
    if any(not part.strip() for part in parts):
        raise ValueError(f"empty signal name in {text!r}")
    return parse_signals(parts, given=text)


def signal_list_text(signals: Sequence[signal.Signals]) -> str:
    """The env form of ``signals``: canonical names joined by commas (``SIGUSR1,SIGTERM``)."""
    return ",".join(s.name for s in signals)
