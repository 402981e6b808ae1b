"""Leader election under API faults a real apiserver cannot be made to produce on demand:
renewals answered 503, a renewal that never answers, two candidates racing for a free
Lease.  The leader must give up within its renew deadline whatever the API does, and a
standby must not take the Lease before a lease duration has passed since it last saw it
change, so two replicas never lead at once.  (The takeover after a SIGKILL, with real
processes and a real apiserver, is ``tests/cluster/test_operations.py``.)

Real: the elector (``refit_operator.shell.leader``), the operator's aiohttp client, the
emulator's resourceVersion preconditions.  Emulated: the API server and its faults.
Timings are scaled down (a 1 s lease) so each case takes a second or two.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.emulator import ApiEmulator, ApiFault

from refit_operator.shell import kube
from refit_operator.shell.leader import Elector, LeaseLost
from refit_operator.shell.lease import Timing

ROOT = Path(__file__).resolve().parents[2]
LEASES = "coordination.k8s.io/v1/leases"
NS = "default"
TIMING = Timing(lease_duration=1.0, renew_deadline=0.5, retry_period=0.1)


@pytest.fixture()
async def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ApiEmulator]:
    async with ApiEmulator(tmp_path) as emulator:
        monkeypatch.setenv("KUBECONFIG", str(emulator.kubeconfig_path))
        yield emulator


def _elector(identity: str) -> Elector:
    return Elector(
        kube.Kube.connect(timeout_s=5), namespace=NS, name="lock", identity=identity, timing=TIMING
    )


def _holder(api: ApiEmulator) -> str:
    return str(api.get(LEASES, NS, "lock")["spec"].get("holderIdentity") or "")


async def test_a_leader_answered_503_gives_up_within_its_renew_deadline(api: ApiEmulator) -> None:
    leader, standby = _elector("a"), _elector("b")
    try:
        await leader.acquire()
        hold = asyncio.create_task(leader.hold())
        standing_by = asyncio.create_task(standby.acquire())
        await asyncio.sleep(0.3)
        assert _holder(api) == "a" and not standing_by.done()
        assert leader.valid() and not standby.valid()
        # From now on every write of the Lease fails; reads still work.
        api.faults.add(ApiFault(code=503, method="PATCH", resource=LEASES, times=1000))
        cut = time.monotonic()
        with pytest.raises(LeaseLost, match=r"not renewed for 0\.5 s"):
            await asyncio.wait_for(hold, timeout=5)
        lost = time.monotonic() - cut
        assert not leader.leading and not leader.valid()
        # Its last renewal began before the cut: it gave up within the deadline of that.
        assert lost <= TIMING.renew_deadline + TIMING.retry_period, lost
        api.faults.clear()
        await asyncio.wait_for(standing_by, timeout=5)
        took_over = time.monotonic() - cut
        # The standby waited a lease duration from the last renewal it saw, so it took
        # over after the leader had stopped.
        assert took_over >= lost and took_over >= TIMING.lease_duration - TIMING.retry_period
        assert _holder(api) == "b" and standby.leading
        assert api.get(LEASES, NS, "lock")["spec"]["leaseTransitions"] == 1
    finally:
        for elector in (leader, standby):
            await elector._api.close()


async def test_a_renewal_that_never_answers_cannot_keep_a_leader_working(
    api: ApiEmulator,
) -> None:
    leader = _elector("a")
    try:
        await leader.acquire()
        hold = asyncio.create_task(leader.hold())
        await asyncio.sleep(0.25)
        # Every request of the Lease now hangs for 30 s before it is served.
        api.faults.add(ApiFault(delay=30.0, resource=LEASES, times=1000))
        cut = time.monotonic()
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(hold, timeout=5)
        assert time.monotonic() - cut <= TIMING.renew_deadline + TIMING.retry_period
    finally:
        await leader._api.close()


async def test_two_candidates_racing_for_a_free_lease_one_leads(api: ApiEmulator) -> None:
    electors = [_elector(name) for name in ("a", "b", "c")]
    try:
        tasks = [asyncio.create_task(e.acquire()) for e in electors]
        done, pending = await asyncio.wait(tasks, timeout=3, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(3 * TIMING.retry_period)
        leaders = [e.identity for e in electors if e.leading]
        assert len(done) == 1 and len(leaders) == 1, leaders
        assert _holder(api) == leaders[0]
        for task in pending:
            assert not task.done()
            task.cancel()
    finally:
        for elector in electors:
            await elector._api.close()


async def test_a_released_lease_is_taken_at_the_next_try(api: ApiEmulator) -> None:
    leader, standby = _elector("a"), _elector("b")
    try:
        await leader.acquire()
        standing_by = asyncio.create_task(standby.acquire())
        await asyncio.sleep(0.3)
        assert not standing_by.done()
        released = time.monotonic()
        await leader.release()
        assert _holder(api) == "" and not leader.leading
        await asyncio.wait_for(standing_by, timeout=5)
        # Well before a lease duration: the standby need not wait for an expiry.
        assert time.monotonic() - released < TIMING.lease_duration
        assert _holder(api) == "b"
        await leader.release()  # not the holder any more: changes nothing
        assert _holder(api) == "b"
    finally:
        for elector in (leader, standby):
            await elector._api.close()


# A replica whose kopf starts late: the SIGTERM lands after the Lease is taken and before
# kopf installs its own handlers, the window a Deployment's rollout can hit.
_LATE_KOPF_REPLICA = """
import asyncio, os, signal
import kopf
from refit_operator.shell import runtime
from refit_operator.shell.lease import Timing
from refit_operator.shell.settings import LeaderElection, OperatorConfig

started = kopf.operator

async def late_kopf(**kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.sleep(0.3)
    await started(**kwargs)
    print("kopf stopped", flush=True)

kopf.operator = late_kopf
timing = Timing(lease_duration=1.0, renew_deadline=0.5, retry_period=0.1)
election = LeaderElection(namespace="default", name="lock", identity="late_1", timing=timing)
asyncio.run(runtime.run(OperatorConfig(namespaces=("default",), leader_election=election)))
"""


async def test_a_stop_between_the_lease_and_kopf_start_is_a_clean_stop(
    api: ApiEmulator,
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "worker")]),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _LATE_KOPF_REPLICA,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    text = output.decode(errors="replace")
    # Not killed by the signal's default action: kopf saw the stop and ended, and the
    # Lease was given up on the way out.
    assert process.returncode == 0, text
    assert "kopf stopped" in text, text
    lease = api.get(LEASES, NS, "lock")
    assert lease["spec"]["acquireTime"] and _holder(api) == "", lease
