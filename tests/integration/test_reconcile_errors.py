"""A reconcile round the apiserver stops (here: the pods cannot be listed, HTTP 403) is not
only in the operator's log: a Warning Event ``ReconcileFailed`` carries the apiserver's
words, once per distinct error, and the round is retried until it goes through.  The
emulator injects the 403; a real apiserver answers 403 only for a missing RBAC rule, which
the cluster tier covers from the chart's side (``tests/cluster/test_chart.py``).

Real: kopf, the handlers, controller and client, aiohttp.  Emulated: the API server.
"""

from __future__ import annotations

from tests.emulator import ApiEmulator
from tests.emulator.faults import ApiFault
from tests.support.operator_run import JOBS, NS, PODS, OperatorRun, eventually, load_job


async def test_a_refused_list_is_announced_in_an_event_and_retried(
    kube_emulator: ApiEmulator, operator: OperatorRun
) -> None:
    api = kube_emulator
    api.faults.add(ApiFault(code=403, method="GET", resource=PODS, watch=False, times=4))
    api.create(JOBS, NS, load_job())

    def warned() -> list[str] | None:
        messages = [
            e["message"]
            for e in api.list("v1/events", NS)
            if e["reason"] == "ReconcileFailed" and e["type"] == "Warning"
        ]
        return messages or None

    messages = await eventually(warned, "a ReconcileFailed event")
    assert "HTTP 403" in messages[0] and "retrying with back-off" in messages[0]
    # Once the apiserver lets the list through, the job's gang is created after all.
    await eventually(lambda: len(api.list(PODS, NS)) == 4 or None, "the gang after the retries")
    assert len(warned() or []) == 1  # the same error is announced once
