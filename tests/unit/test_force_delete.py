"""The force delete of a pod on an out-of-service node as it goes to the API: ``DELETE``
with ``DeleteOptions`` (grace 0, a uid precondition), a 409 from that precondition (a
successor holds the name) taken as done, any other refusal shown; a plain delete still
sends no options; a Node is read by name, and a missing one is None.

Real: ``kube.Kube``'s request building and error mapping, ``KubeWrites``.  Emulated: the
HTTP exchange (the answers are what the apiserver sends; the real server's are in
``tests/cluster/test_node_death.py``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from refit_operator.core.decision import Delete
from refit_operator.shell import kube
from refit_operator.shell.kube_writes import KubeWrites

JOB = {"metadata": {"name": "job", "namespace": "ns", "resourceVersion": "3", "uid": "u"}}


class Answering(kube.Kube):
    """A client whose every request gets ``answer`` (a status code and a body)."""

    def __init__(self, status: int = 200, body: Any = None) -> None:
        super().__init__("https://api.invalid")
        self.sent: list[tuple[str, str, Any]] = []
        self._answer = (status, body)

    async def request(self, method: str, path: str, *, body: Any = None, **_: Any) -> Any:
        self.sent.append((method, path, json.loads(json.dumps(body))))
        status, answer = self._answer
        if status >= 400:
            error = kube.ConflictError if status == 409 else kube.ApiError
            raise error(status, method, path, str(answer), "Conflict" if status == 409 else "")
        return answer


def _delete(api: Answering, action: Delete) -> Any:
    return asyncio.run(KubeWrites(api, JOB).delete(action))


def test_a_force_delete_sends_grace_zero_and_the_uid_precondition() -> None:
    api = Answering()
    assert (
        _delete(api, Delete("v1", "Pod", "job-rollout-1", grace_period_seconds=0, uid="u-7"))
        is None
    )
    assert api.sent == [
        (
            "DELETE",
            "/api/v1/namespaces/ns/pods/job-rollout-1",
            {
                "apiVersion": "v1",
                "kind": "DeleteOptions",
                "gracePeriodSeconds": 0,
                "preconditions": {"uid": "u-7"},
            },
        )
    ]


def test_a_plain_delete_sends_no_options() -> None:
    api = Answering()
    assert _delete(api, Delete("v1", "Pod", "job-rollout-1")) is None
    assert api.sent == [("DELETE", "/api/v1/namespaces/ns/pods/job-rollout-1", None)]


def test_a_successor_under_the_name_is_not_deleted_and_not_an_error() -> None:
    api = Answering(409, "Precondition failed: UID in precondition: u-7, UID in object meta: u-8")
    assert _delete(api, Delete("v1", "Pod", "p", grace_period_seconds=0, uid="u-7")) is None


def test_a_refused_force_delete_is_shown() -> None:
    api = Answering(403, 'pods "p" is forbidden')
    refused = _delete(api, Delete("v1", "Pod", "p", grace_period_seconds=0, uid="u-7"))
    assert refused is not None and (refused.verb, refused.status) == ("delete", 403)
    # Without a uid precondition a 409 is no successor's: it is shown too.
    conflict = _delete(Answering(409, "conflict"), Delete("v1", "Pod", "p"))
    assert conflict is not None and conflict.status == 409


def test_a_node_is_read_by_name_and_a_missing_one_is_none() -> None:
    api = Answering(200, {"metadata": {"name": "node-a"}})
    assert asyncio.run(api.get_node("node-a")) == {"metadata": {"name": "node-a"}}
    assert api.sent == [("GET", "/api/v1/nodes/node-a", None)]
    assert asyncio.run(Answering(404, "not found").get_node("node-a")) is None
