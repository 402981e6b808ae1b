"""The signal handler across real process groups.

Real: gloo process groups between separate processes (``TCPStore`` on a free port), the
signal sent with ``os.kill`` to one rank's pid, the demo module that users run.  The
in-process tests use a real one-rank gloo group and torch's own ``fake`` backend (an
unsupported backend, to check the error names it).  Nothing is emulated.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from refit_worker.contract.exits import EXIT_PREEMPTED
from refit_worker.signals.handler import DistributedSignalHandler, all_gather_item, get_device
from signal_gang import DemoSettings, run_demo

ROOT = Path(__file__).resolve().parents[2]
#: Children import refit_worker from this checkout, installed or not.
CHILD_ENV = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "worker"), os.environ.get("PYTHONPATH")])),
)


@pytest.mark.parametrize(
    ("ranks", "signal_rank", "signal_at", "sig"),
    [(3, 2, 3, signal.SIGTERM), (4, 0, 0, signal.SIGUSR1)],
)
def test_one_signalled_rank_stops_the_whole_gang_at_the_same_step(
    ranks: int, signal_rank: int, signal_at: int, sig: signal.Signals
) -> None:
    settings = DemoSettings(
        ranks=ranks, steps=20, signal_rank=signal_rank, signal_at=signal_at, sig=sig, timeout=120
    )
    result = run_demo(settings, out=sys.stderr)
    expected = [rank == signal_rank for rank in range(ranks)]
    assert result.problems() == []
    assert len({r.pid for r in result.reports}) == ranks  # separate processes
    for report in result.reports:
        assert report.seen == expected  # exactly the signalled rank, as bools
        assert all(type(flag) is bool for flag in report.seen)
        assert report.stopped_at == signal_at  # the first poll after the signal
        assert report.polls_before == signal_at  # every earlier poll was all-false
        assert report.exit_code == EXIT_PREEMPTED


GATHER_RANK = """
import json, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from torch._C._distributed_c10d import TCPStore
from refit_worker.signals.handler import DistributedSignalHandler, all_gather_item, get_device
rank, world, port = map(int, sys.argv[1:4])
limit = timedelta(seconds=60)
store = TCPStore("127.0.0.1", port, is_master=False, timeout=limit)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=limit)
last = world - 1
if rank == last:
    time.sleep(1.5)  # the others' async gathers must wait for this rank's value
full = all_gather_item(rank * 10 + 1, torch.int64, async_op=True)
pair = dist.new_group([0, last])
sub = None
if rank in (0, last):
    sub = all_gather_item(rank + 0.5, torch.float64, group=pair, async_op=True)
with DistributedSignalHandler("SIGUSR2") as handler:
    flags = handler.signals_received()
print(json.dumps({"rank": rank, "full": full, "sub": sub, "flags": flags,
                  "device": str(get_device(group=pair)) if sub else None}), flush=True)
dist.destroy_process_group()
"""


def test_async_gather_waits_for_the_slowest_rank() -> None:
    world = 3
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GATHER_RANK, str(rank), str(world), str(store.port)],
            env=CHILD_ENV,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    assert [proc.returncode for proc in procs] == [0] * world
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    for rank, report in enumerate(reports):
        assert report["rank"] == rank
        assert report["full"] == [1, 11, 21]  # zeros here would mean an unfinished read
        assert report["flags"] == [False, False, False]
        assert all(type(flag) is bool for flag in report["flags"])  # JSON false, not 0
    assert reports[0]["sub"] == reports[2]["sub"] == [0.5, 2.5]  # the subgroup's own size
    assert reports[1]["sub"] is None
    assert reports[0]["device"] == "cpu"


@pytest.fixture
def one_rank_group(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[None]:
    """A real one-process group with the backend string the test names."""
    dist.init_process_group(
        request.param,
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=30),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("one_rank_group", ["gloo", "cpu:gloo,cuda:gloo"], indirect=True)
@pytest.mark.usefixtures("one_rank_group")
def test_mixed_backend_strings_gather_on_cpu() -> None:
    assert get_device() == torch.device("cpu")
    assert all_gather_item(7, torch.int32) == [7]
    with DistributedSignalHandler(signal.SIGUSR1) as handler:
        assert handler.signals_received() == [False]
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.signals_received() == [True]


@pytest.mark.parametrize("one_rank_group", ["gloo"], indirect=True)
@pytest.mark.usefixtures("one_rank_group")
def test_device_follows_the_group_passed_not_the_default() -> None:
    # torch's test-only backend: registering it is the import's side effect.
    import torch.testing._internal.distributed.fake_pg

    fake = dist.new_group(backend="fake")
    assert get_device() == torch.device("cpu")  # the default group is gloo
    with pytest.raises(RuntimeError, match="'fake'"):
        get_device(group=fake)
    with pytest.raises(RuntimeError, match=r"unsupported torch\.distributed backend 'fake'"):
        all_gather_item(1, torch.int32, group=fake)
    with pytest.raises(RuntimeError, match="'fake'"):
        DistributedSignalHandler(signal.SIGUSR1, group=fake).signals_received()


def test_demo_command_as_the_readme_runs_it() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "signal_gang.py")],
        env=CHILD_ENV,
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "demo: step 5: sent SIGTERM to rank 1" in lines[0]
    assert sorted(line for line in lines if line.startswith("rank ")) == [
        f"rank {rank}: stopped at step 5; signal seen on rank(s) [1]" for rank in range(3)
    ]
    assert lines[-1].startswith("demo: all 3 ranks stopped together at step 5 after SIGTERM")
