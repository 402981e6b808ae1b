"""The signal vocabulary (``refit_worker.contract.signals``): resolution, lists, the CRD's
pattern from the same table; and the device a group's backend implies.

All pure: no handlers installed, no processes, no process group.
"""

from __future__ import annotations

import re
import signal

import pytest
import torch

from refit_worker.contract import signals as vocabulary
from refit_worker.contract.signals import SignalLike, parse_signal_list
from refit_worker.signals.handler import (
    DistributedSignalHandler,
    device_for_backend,
    resolve_signal,
)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (signal.SIGTERM, signal.SIGTERM),
        (15, signal.SIGTERM),
        (int(signal.SIGUSR1), signal.SIGUSR1),
        ("SIGTERM", signal.SIGTERM),
        ("sigterm", signal.SIGTERM),
        ("TERM", signal.SIGTERM),
        ("term", signal.SIGTERM),
        ("SigUsr1", signal.SIGUSR1),
        ("usr2", signal.SIGUSR2),
        ("  SIGINT\n", signal.SIGINT),
        ("\tint ", signal.SIGINT),
        ("15", signal.SIGTERM),
        (" 10 ", signal.SIGUSR1),
    ],
)
def test_resolve_accepts(given: SignalLike, expected: signal.Signals) -> None:
    resolved = resolve_signal(given)
    assert resolved is expected
    assert isinstance(resolved, signal.Signals)


@pytest.mark.parametrize("given", [True, False, 1.5, None, b"SIGTERM", [15], object()])
def test_resolve_rejects_other_types(given: object) -> None:
    with pytest.raises(TypeError, match=type(given).__name__):
        resolve_signal(given)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "given", ["SIGNOPE", "nope", "", "   ", "SIG", "SIG_DFL", "SIG TERM", "\u017figterm"]
)
def test_resolve_rejects_unknown_names(given: str) -> None:
    with pytest.raises(ValueError, match="Unknown signal name") as caught:
        resolve_signal(given)
    assert repr(given) in str(caught.value)


@pytest.mark.parametrize("given", [0, -1, 999, "999"])
def test_resolve_rejects_unknown_numbers(given: int | str) -> None:
    with pytest.raises(ValueError, match="Invalid signal number") as caught:
        resolve_signal(given)
    assert repr(given) in str(caught.value)


def test_signal_list_from_env_text() -> None:
    assert parse_signal_list("SIGTERM") == (signal.SIGTERM,)
    assert parse_signal_list(" usr1 , SIGUSR2") == (signal.SIGUSR1, signal.SIGUSR2)
    assert vocabulary.signal_list_text((signal.SIGUSR1, signal.SIGTERM)) == "SIGUSR1,SIGTERM"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty signal name"),
        ("SIGTERM,", "empty signal name"),
        ("SIGTERM,,USR1", "empty signal name"),
        ("TERM,15", "SIGTERM given more than once"),
        ("SIGTERM,BOGUS", "'BOGUS'"),
        ("usr1,KILL", "signal 'KILL' cannot be caught"),
    ],
)
def test_signal_list_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_signal_list(text)


def test_handler_takes_one_or_many_signals() -> None:
    assert DistributedSignalHandler().sigs == (signal.SIGTERM,)
    assert DistributedSignalHandler("usr1").sig is signal.SIGUSR1
    many = DistributedSignalHandler(["USR2", 10, signal.SIGTERM])
    assert many.sigs == (signal.SIGUSR2, signal.SIGUSR1, signal.SIGTERM)
    assert many.sig is signal.SIGUSR2  # the first one
    assert DistributedSignalHandler(("term",)).sigs == (signal.SIGTERM,)


@pytest.mark.parametrize(
    ("sig", "error", "message"),
    [
        ([], ValueError, "empty sequence"),
        ((), ValueError, "empty sequence"),
        (["SIGTERM", "term"], ValueError, "SIGTERM given more than once"),
        ([15, signal.SIGTERM], ValueError, "SIGTERM given more than once"),
        ("SIGKILL", ValueError, "'SIGKILL' cannot be caught"),
        (["USR1", "STOP"], ValueError, "'STOP' cannot be caught"),
        (["USR1", "NOPE"], ValueError, "'NOPE'"),
        (True, TypeError, "bool"),
        ({15}, TypeError, "set"),
        ([15, 2.0], TypeError, "float"),
    ],
)
def test_handler_rejects_bad_signals(sig: object, error: type[Exception], message: str) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(error, match=message):
        DistributedSignalHandler(sig)  # type: ignore[arg-type]
    assert signal.getsignal(signal.SIGUSR1) == before  # nothing installed


@pytest.mark.parametrize(
    ("backend", "local_rank", "expected"),
    [
        ("gloo", None, torch.device("cpu")),
        ("GLOO", 3, torch.device("cpu")),
        ("nccl", None, torch.device("cuda")),
        ("nccl", 2, torch.device("cuda", 2)),
        ("cpu:gloo,cuda:nccl", 1, torch.device("cpu")),  # CPU preferred for a 1-element gather
        ("cuda:nccl,cpu:gloo", None, torch.device("cpu")),
        ("cuda:nccl", 0, torch.device("cuda", 0)),
        ("cpu:gloo", None, torch.device("cpu")),
        ("cpu:mpi,cuda:nccl", 4, torch.device("cuda", 4)),
    ],
)
def test_device_follows_backend(
    backend: str, local_rank: int | None, expected: torch.device
) -> None:
    assert device_for_backend(backend, local_rank) == expected


@pytest.mark.parametrize("backend", ["mpi", "ucc", "fake", "", "cuda:gloo", "cpu:nccl", "xccl"])
def test_device_rejects_unsupported_backend(backend: str) -> None:
    with pytest.raises(RuntimeError, match=r"unsupported torch\.distributed backend") as caught:
        device_for_backend(backend)
    assert repr(backend) in str(caught.value)


@pytest.mark.parametrize("member", list(signal.Signals), ids=lambda s: s.name)
def test_the_crd_pattern_and_the_parser_agree(member: signal.Signals) -> None:
    # One table: every spelling the parser takes by name, the CRD's pattern takes, and
    # the other way round; uncatchable names neither.
    pattern = re.compile(vocabulary.SIGNAL_PATTERN)
    short = member.name.removeprefix("SIG")
    for spelling in (member.name, short.lower(), "Sig" + short.lower()):
        catchable = member not in vocabulary.UNCATCHABLE
        assert bool(pattern.fullmatch(spelling)) is catchable
        if catchable:
            assert vocabulary.canonical_name(spelling) == member.name
        else:
            with pytest.raises(ValueError, match="cannot be caught"):
                vocabulary.canonical_name(spelling)
    for not_a_name in (str(int(member)), f" {short}", "\u017fig" + short.lower()):
        assert not pattern.fullmatch(not_a_name)


def test_kubelet_stop_signals_are_catchable_names() -> None:
    assert "SIGTERM" in vocabulary.KUBELET_STOP_SIGNALS
    assert "SIGUSR1" in vocabulary.KUBELET_STOP_SIGNALS
    for name in ("SIGKILL", "SIGSTOP", "SIGRTMIN", "SIGRTMAX"):
        assert name not in vocabulary.KUBELET_STOP_SIGNALS


@pytest.mark.parametrize("member", list(signal.Signals), ids=lambda s: s.name)
def test_every_signal_resolves_from_each_spelling(member: signal.Signals) -> None:
    short = member.name.removeprefix("SIG")
    for spelling in (
        member,
        int(member),
        str(int(member)),
        member.name,
        short.lower(),
        f" {short} ",
    ):
        assert resolve_signal(spelling) is member
