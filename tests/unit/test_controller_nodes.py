"""What the controller reads of Nodes each round: one GET per node the job's pods are
bound to (none for an unscheduled pod, one for pods sharing a node), a Node that answers
404 is gone (its pods are lost), and a 403 (a chart older than the operator, without the
``get nodes`` right) leaves the round without node facts instead of stopping it; any other
error stops the round, to be retried.

Real: ``controller.Controller``'s node reading, ``kube.Kube``'s error mapping.  Emulated:
the HTTP answers (what the apiserver sends; the real server in
``tests/cluster/test_node_death.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from refit_operator.render.pods import RenderOptions
from refit_operator.shell import kube
from refit_operator.shell.controller import Controller

READY = {"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-01T00:00:00Z"}


class Nodes(kube.Kube):
    """Answers GETs of Nodes from ``known``; ``status`` for every request when set."""

    def __init__(self, known: dict[str, Any], status: int | None = None) -> None:
        super().__init__("https://api.invalid")
        self.paths: list[str] = []
        self._known, self._status = known, status

    async def request(self, method: str, path: str, **_: Any) -> Any:
        self.paths.append(path)
        if self._status is not None:
            raise kube.ApiError(self._status, method, path, "nodes is forbidden", "Forbidden")
        name = path.rsplit("/", 1)[1]
        if name not in self._known:
            raise kube.ApiError(404, method, path, "not found", "NotFound")
        return self._known[name]


def _pod(node: str | None) -> dict[str, Any]:
    return {"metadata": {"name": "p"}, "spec": {"nodeName": node} if node else {}}


def _read(api: Nodes, *nodes: str | None) -> Any:
    return asyncio.run(Controller(api, RenderOptions()).read_nodes([_pod(n) for n in nodes]))


def test_one_get_per_node_and_a_gone_node_is_gone() -> None:
    api = Nodes({"node-a": {"metadata": {"name": "node-a"}, "status": {"conditions": [READY]}}})
    facts = _read(api, "node-a", "node-a", None, "node-x")
    assert sorted(api.paths) == ["/api/v1/nodes/node-a", "/api/v1/nodes/node-x"]
    assert facts["node-a"].healthy
    assert not facts["node-x"].exists


def test_without_the_right_to_read_nodes_the_round_goes_on_without_them() -> None:
    assert _read(Nodes({}, status=403), "node-a") == {}


def test_another_error_stops_the_round() -> None:
    with pytest.raises(kube.ApiError):
        _read(Nodes({}, status=500), "node-a")
