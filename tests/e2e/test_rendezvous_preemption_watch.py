"""A worker process hears the job-wide preemption notice and stops through its own signal.

Real: a separate worker process, the file-backed store it shares with the test (the
coordinator), a real SIGTERM the worker sends itself with ``os.kill`` when the notice
arrives, and its exit code; the kubernetes client failing against a closed port.
Nothing is emulated.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from refit_worker.contract.exits import EXIT_PREEMPTED
from refit_worker.contract.rendezvous import PREEMPT_KEY, Layout, PreemptNotice, make_preempt_notice
from refit_worker.rendezvous import (
    ConfigMapStore,
    FileStore,
    Member,
    PreemptionWatch,
    RendezvousError,
)

ROOT = Path(__file__).resolve().parents[2]

# The pattern a worker uses: the notice becomes the preemption signal, so the signal
# handler (here a plain one) stops the work at its next safe point.
WORKER = r"""
import json, os, signal, sys, time
from refit_worker.contract.exits import EXIT_PREEMPTED
from refit_worker.rendezvous import FileStore, Member, PreemptionWatch
from refit_worker.contract.rendezvous import Layout
order = json.loads(sys.argv[1])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
store = FileStore(order["dir"], Layout(1, 1, 1))
me = Member("rollout", 0, order["epoch"], "me")
with PreemptionWatch(store, me, lambda n: os.kill(os.getpid(), signal.SIGTERM)) as watch:
    print("watching", flush=True)
    steps = 0
    while not stop and steps < 600:  # one "bucket" per 50 ms, at most 30 s
        time.sleep(0.05)
        steps += 1
print(json.dumps({"stopped": bool(stop), "reason": watch.notice and watch.notice.reason}),
      flush=True)
sys.exit(EXIT_PREEMPTED if stop else 0)
"""


def test_notice_of_own_epoch_stops_the_worker_by_signal(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "worker"))
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, json.dumps({"dir": str(tmp_path), "epoch": 4})],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "watching"
    coordinator = FileStore(tmp_path, Layout(1, 1, 1))
    coordinator.post_preemption(make_preempt_notice(3, "job-policy-0", "old", "stale epoch"))
    time.sleep(0.6)
    assert proc.poll() is None  # another epoch's notice leaves it running
    coordinator.post_preemption(make_preempt_notice(4, "job-policy-0", "p0", "node drain"))
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert json.loads(out) == {"stopped": True, "reason": "node drain"}


def test_stop_ends_the_watch_promptly_and_a_garbage_notice_is_reported(tmp_path: Path) -> None:
    store = FileStore(tmp_path, Layout(1, 1, 1))
    me = Member("policy", 0, 0, "me")
    heard: list[PreemptNotice] = []
    watch = PreemptionWatch(store, me, heard.append).start()
    time.sleep(0.3)
    started = time.monotonic()
    watch.stop()
    assert time.monotonic() - started < 2.0
    assert not watch._thread.is_alive()
    assert heard == [] and watch.error is None

    (tmp_path / "shard-0" / PREEMPT_KEY).write_text("{not json")
    with PreemptionWatch(store, me, heard.append) as broken:
        deadline = time.monotonic() + 10
        while broken.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert heard == []
    assert "rendezvous key 'preempt': value is not JSON" in str(broken.error)


def test_an_unreachable_api_ends_the_watch_with_its_error() -> None:
    from kubernetes import client

    with socket.socket() as sock:  # a port nobody listens on once this closes
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    api = client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}"))
    store = ConfigMapStore("job-rendezvous", "default", Layout(1, 1, 1), api_client=api)
    heard = threading.Event()
    watch = PreemptionWatch(store, Member("policy", 0, 0, "u"), lambda n: heard.set()).start()
    watch._thread.join(30)
    assert not heard.is_set()
    assert isinstance(watch.error, RendezvousError)
    assert "could not read ConfigMap default/job-rendezvous" in str(watch.error)
    api.close()
