"""The worker's teardown is bounded.  Its torch.distributed group's teardown can wait for
a collective's timeout (a peer gone mid-collective), past the pod's grace period, so the
worker waits a few seconds for it; the destroy is stood in for by functions that finish
at once or hang.  Then the process exits with its code and without the interpreter's own
teardown (destructors, atexit): a real child process shows it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import refit_worker.__main__ as worker_main


def test_a_teardown_that_finishes_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    called = threading.Event()
    monkeypatch.setattr(worker_main.dist, "destroy_process_group", called.set)
    assert worker_main.destroy_group(5.0)
    assert called.is_set()


def test_a_teardown_that_hangs_is_left_behind_within_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    monkeypatch.setattr(worker_main.dist, "destroy_process_group", lambda: release.wait(30))
    started = time.monotonic()
    try:
        assert not worker_main.destroy_group(0.3)
        assert time.monotonic() - started < 5.0
    finally:
        release.set()


# A child that logs, leaves an atexit hook that would hang (as a stuck destructor does)
# and a line unflushed in stdout's buffer, then exits through the worker's exit.
_CHILD = """
import atexit, logging, sys, threading
from refit_worker.__main__ import exit_now
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
atexit.register(lambda: (open(sys.argv[1], "w").write("ran"), threading.Event().wait(60)))
logging.getLogger("probe").info("logged before the exit")
sys.stdout.write("buffered, not flushed")
exit_now(83)
"""


def test_the_exit_skips_the_interpreters_teardown_and_keeps_the_code(tmp_path: Path) -> None:
    marker = tmp_path / "atexit-ran"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(marker)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 83, done.stderr
    assert not marker.exists()  # the hook that would have hung never ran
    # What was logged and written still came out: the exit flushes first.
    assert "logged before the exit" in done.stdout
    assert done.stdout.endswith("buffered, not flushed")
