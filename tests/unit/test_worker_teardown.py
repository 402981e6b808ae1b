"""The worker's teardown of its torch.distributed group is bounded: with a peer gone
mid-collective it can wait for that collective's timeout, past the pod's grace period, so
the worker waits a few seconds for it and exits without it.  The destroy is stood in for
by functions that finish at once or hang; nothing else is faked."""

from __future__ import annotations

import threading
import time

import pytest

import refit_worker.__main__ as worker_main


def test_a_teardown_that_finishes_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_main, "TEARDOWN_STUCK", threading.Event())
    called = threading.Event()
    monkeypatch.setattr(worker_main.dist, "destroy_process_group", called.set)
    assert worker_main.destroy_group(5.0)
    assert called.is_set() and not worker_main.TEARDOWN_STUCK.is_set()


def test_a_teardown_that_hangs_is_left_behind_within_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_main, "TEARDOWN_STUCK", threading.Event())
    release = threading.Event()
    monkeypatch.setattr(worker_main.dist, "destroy_process_group", lambda: release.wait(30))
    started = time.monotonic()
    try:
        assert not worker_main.destroy_group(0.3)
        assert time.monotonic() - started < 5.0
        # The process then exits without the interpreter's own teardown.
        assert worker_main.TEARDOWN_STUCK.is_set()
    finally:
        release.set()
