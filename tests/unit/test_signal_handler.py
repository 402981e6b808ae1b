"""``DistributedSignalHandler`` in one process (torch.distributed not initialised).

Real: handlers installed with ``signal.signal``, signals sent with ``os.kill`` to this very
process, registration files in a temporary directory.  Only SIGUSR1/SIGUSR2 are sent, so
pytest's own handlers are never in the way.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
import torch.distributed as dist

from refit_worker.contract.env import SIGNAL_PID_DIR_ENV
from refit_worker.signals.handler import DistributedSignalHandler
from refit_worker.signals.pid_registry import read_proc_state

calls: list[int] = []


def _marker(signum: int, frame: FrameType | None) -> None:
    calls.append(signum)


@pytest.fixture(autouse=True)
def _own_handlers() -> Iterator[None]:
    """Start each test with a known Python handler on SIGUSR1/2, and put them back after."""
    assert not dist.is_initialized()
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    for s in saved:
        signal.signal(s, _marker)
    calls.clear()
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_enter_installs_and_exit_restores() -> None:
    handler = DistributedSignalHandler(signal.SIGUSR1)
    with handler as entered:
        assert entered is handler
        assert signal.getsignal(signal.SIGUSR1) not in (_marker, signal.SIG_DFL)
        assert handler.original_handlers == {signal.SIGUSR1: _marker}
        assert signal.getsignal(signal.SIGUSR2) is _marker  # untouched
    assert signal.getsignal(signal.SIGUSR1) is _marker


def test_real_signal_sets_the_flag_only() -> None:
    with DistributedSignalHandler("SIGUSR1") as handler:
        assert handler.signals_received() == [False]
        os.kill(os.getpid(), signal.SIGUSR1)
        received = handler.signals_received()
        assert received == [True]
        assert type(received[0]) is bool
        assert calls == []  # the original handler did not run
    os.kill(os.getpid(), signal.SIGUSR1)  # after exit the original handler runs again
    assert calls == [signal.SIGUSR1]
    assert handler.signals_received() == [True]  # the flag stays readable after exit


def test_each_of_several_signals_is_heard() -> None:
    for sent in (signal.SIGUSR1, signal.SIGUSR2):
        with DistributedSignalHandler(["usr1", "USR2"]) as handler:
            assert handler.sig is signal.SIGUSR1
            os.kill(os.getpid(), sent)
            assert handler.signals_received() == [True]
        assert signal.getsignal(signal.SIGUSR1) is _marker
        assert signal.getsignal(signal.SIGUSR2) is _marker
    assert calls == []


def test_nested_handlers_restore_in_order() -> None:
    with DistributedSignalHandler(signal.SIGUSR1) as outer:
        outer_installed = signal.getsignal(signal.SIGUSR1)
        with DistributedSignalHandler(signal.SIGUSR1) as inner:
            assert inner.original_handlers == {signal.SIGUSR1: outer_installed}
            os.kill(os.getpid(), signal.SIGUSR1)
            assert inner.signals_received() == [True]
            assert outer.signals_received() == [False]  # the inner one took it
        assert signal.getsignal(signal.SIGUSR1) == outer_installed
        os.kill(os.getpid(), signal.SIGUSR1)
        assert outer.signals_received() == [True]
    assert signal.getsignal(signal.SIGUSR1) is _marker
    assert calls == []


def test_release_twice_and_before_enter() -> None:
    handler = DistributedSignalHandler(signal.SIGUSR2)
    assert handler.release() is False  # never entered
    handler.__enter__()
    assert handler.release() is True
    assert signal.getsignal(signal.SIGUSR2) is _marker
    assert handler.release() is False
    handler.__exit__(None, None, None)  # exit after release changes nothing
    assert signal.getsignal(signal.SIGUSR2) is _marker


def test_handlers_restored_when_the_body_raises() -> None:
    with pytest.raises(KeyError), DistributedSignalHandler(signal.SIGUSR1):
        raise KeyError("boom")
    assert signal.getsignal(signal.SIGUSR1) is _marker


def test_reenter_is_refused_and_changes_nothing() -> None:
    with DistributedSignalHandler(signal.SIGUSR1) as handler:
        installed = signal.getsignal(signal.SIGUSR1)
        with pytest.raises(RuntimeError, match="already entered"):
            handler.__enter__()
        assert signal.getsignal(signal.SIGUSR1) == installed
    assert signal.getsignal(signal.SIGUSR1) is _marker


def test_a_flag_is_cleared_by_a_new_entry() -> None:
    handler = DistributedSignalHandler(signal.SIGUSR1)
    with handler:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.signals_received() == [True]
    with handler:
        assert handler.signals_received() == [False]


def test_entering_off_the_main_thread_is_a_clear_error() -> None:
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            DistributedSignalHandler(signal.SIGUSR1).__enter__()
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=enter, name="not-main")
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert len(errors) == 1
    assert isinstance(errors[0], RuntimeError)
    assert "main thread" in str(errors[0])
    assert "'not-main'" in str(errors[0])
    assert signal.getsignal(signal.SIGUSR1) is _marker


def test_registration_lives_as_long_as_the_handler(tmp_path: Path) -> None:
    with DistributedSignalHandler(["USR2", "USR1"], pid_dir=tmp_path):
        files = list(tmp_path.iterdir())
        assert len(files) == 1
        assert files[0].name.startswith(f"{os.getpid()}-")
        assert files[0].suffix == ".json"
        record = json.loads(files[0].read_text())
        own = read_proc_state(os.getpid())
        assert own is not None
        assert record == {
            "version": 1,
            "pid": os.getpid(),
            "start_time": own.start_time,
            "signals": ["SIGUSR2", "SIGUSR1"],
        }
        with DistributedSignalHandler(signal.SIGUSR1, pid_dir=str(tmp_path)):  # nested: own file
            assert len(list(tmp_path.iterdir())) == 2
        assert [f.name for f in tmp_path.iterdir()] == [files[0].name]
    assert list(tmp_path.iterdir()) == []


def test_the_environment_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The pid dir comes from the caller (WorkerConfig or Preemption.from_env), not os.environ.
    monkeypatch.setenv(SIGNAL_PID_DIR_ENV, str(tmp_path))
    for pid_dir in (None, ""):
        with DistributedSignalHandler(signal.SIGUSR1, pid_dir=pid_dir):
            assert list(tmp_path.iterdir()) == []


def test_bad_registration_dir_changes_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    handler = DistributedSignalHandler(signal.SIGUSR1, pid_dir=missing)
    with pytest.raises(NotADirectoryError, match="no-such-dir") as caught:
        handler.__enter__()
    assert SIGNAL_PID_DIR_ENV in str(caught.value)
    assert signal.getsignal(signal.SIGUSR1) is _marker
    assert handler.release() is False
    assert not missing.exists()
