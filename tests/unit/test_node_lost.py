"""Pods lost with their node (pure): the decision from a Node's facts (Ready, how long
not, the out-of-service taint, a Node that is gone) and ``nodeLostSeconds``, what a round
observes of it, and what the reconcile does about it whatever its steps decide: a
``NodeLost`` Event naming the node, a force delete (grace 0, uid precondition) on an
out-of-service node, a look again when the bound will be over.

Real: the models, the renderers, the observation, the reconcile.  No API is involved; the
real node-lifecycle controller is in ``tests/cluster/test_node_death.py``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from refit_operator.api.models import Phase, RefitJobStatus, parse_spec
from refit_operator.core import lost_nodes
from refit_operator.core.decision import Delete, Emit, JobView
from refit_operator.core.nodes import (
    DEFAULT_NODE_LOST_SECONDS,
    OUT_OF_SERVICE,
    gone_node,
    lost_after,
    node_facts,
    node_lost,
    node_lost_seconds,
)
from refit_operator.core.observe import observe
from refit_operator.core.reconcile import reconcile
from refit_operator.render.children import render_static
from refit_operator.render.pods import JobRef, RenderOptions, render_gang

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
REF = JobRef(name="job", namespace="ns", uid="u-1")
SPEC: dict[str, Any] = {"image": "i", "policy": {"replicas": 1}, "rollout": {"replicas": 2}}
RUNNING = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}


def _node(name: str, ready: str, ago: float, *taints: str) -> dict[str, Any]:
    since = (NOW - timedelta(seconds=ago)).isoformat().replace("+00:00", "Z")
    return {
        "metadata": {"name": name},
        "spec": {"taints": [{"key": t, "effect": "NoExecute"} for t in taints]},
        "status": {
            "conditions": [
                {"type": "MemoryPressure", "status": "False"},
                {"type": "Ready", "status": ready, "lastTransitionTime": since},
            ]
        },
    }


@pytest.mark.parametrize(
    ("ready", "ago", "taints", "said"),
    [
        ("True", 500, (), None),
        ("False", 29, (), None),
        ("False", 34, (), "node node-a NotReady for 34s"),
        ("Unknown", 10, (), None),
        ("Unknown", 31, (), "node node-a unreachable (Ready Unknown) for 31s"),
        # A person said the node is shut down: no bound to wait out, Ready or not.
        ("True", 500, (OUT_OF_SERVICE,), "node node-a is out of service"),
        ("Unknown", 1, (OUT_OF_SERVICE,), "node node-a is out of service"),
        # The node-lifecycle controller's own taints are not the person's word.
        ("True", 500, ("node.kubernetes.io/unreachable",), None),
    ],
)
def test_node_lost_from_the_ready_condition_and_the_taint(
    ready: str, ago: float, taints: tuple[str, ...], said: str | None
) -> None:
    facts = node_facts(_node("node-a", ready, ago, *taints))
    assert node_lost(facts, NOW, 30.0) == said


def test_a_node_that_is_gone_or_has_no_transition_time_loses_its_pods_now() -> None:
    assert node_lost(gone_node("node-x"), NOW, 30.0) == "node node-x no longer exists"
    bare = node_facts(
        {
            "metadata": {"name": "n"},
            "status": {"conditions": [{"type": "Ready", "status": "False"}]},
        }
    )
    assert node_lost(bare, NOW, 30.0) == "node n NotReady since an unknown time"
    assert node_lost(None, NOW, 30.0) is None  # a node not read says nothing


def test_the_bound_is_waited_out_from_the_transition_time() -> None:
    facts = node_facts(_node("node-a", "Unknown", 12))
    assert lost_after(facts, NOW, 30.0) == pytest.approx(18.0)
    assert lost_after(node_facts(_node("node-a", "Unknown", 40)), NOW, 30.0) is None
    assert lost_after(node_facts(_node("node-a", "True", 40)), NOW, 30.0) is None


@pytest.mark.parametrize(
    ("raw", "bound"),
    [
        ({}, DEFAULT_NODE_LOST_SECONDS),
        ({"failurePolicy": {"maxRestarts": 1}}, DEFAULT_NODE_LOST_SECONDS),
        ({"failurePolicy": {"nodeLostSeconds": 5}}, 5.0),
        ({"failurePolicy": {"nodeLostSeconds": 0}}, 0.0),
        # Not the reader's to refuse (validation does): the default meanwhile.
        ({"failurePolicy": {"nodeLostSeconds": -1}}, DEFAULT_NODE_LOST_SECONDS),
        ({"failurePolicy": {"nodeLostSeconds": "5"}}, DEFAULT_NODE_LOST_SECONDS),
        ({"failurePolicy": {"nodeLostSeconds": True}}, DEFAULT_NODE_LOST_SECONDS),
        (None, DEFAULT_NODE_LOST_SECONDS),
    ],
)
def test_node_lost_seconds_is_read_from_the_raw_spec(raw: Any, bound: float) -> None:
    assert node_lost_seconds(raw) == bound


def _pods(node_of: dict[int, str], status: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The job's gang (epoch 0) bound to nodes by index, each Running unless told."""
    out = []
    for index, pod in enumerate(render_gang(REF, parse_spec(SPEC), 0, RenderOptions())):
        pod["metadata"]["uid"] = f"uid-{index}"
        pod["metadata"]["resourceVersion"] = "7"
        pod["spec"]["nodeName"] = node_of.get(index, "node-b")
        pod["status"] = dict(status or RUNNING)
        out.append(pod)
    return out


def _round(
    pods: list[dict[str, Any]],
    nodes: dict[str, dict[str, Any]],
    bound: float = 30.0,
    status: RefitJobStatus | None = None,
):
    facts = {name: node_facts(node) for name, node in nodes.items()}
    observed = observe(
        pods,
        render_static(REF, parse_spec(SPEC)),
        {"job-rendezvous": {}},
        nodes=facts,
        now=NOW,
        node_lost_seconds=bound,
    )
    if status is None:
        status = RefitJobStatus(created_epoch=0, phase=Phase.RUNNING)
    job = JobView(ref=REF, generation=1, raw_spec=SPEC, status=status)
    return observed, reconcile(job, observed, NOW, RenderOptions())


def test_a_round_observes_which_pods_are_lost_and_says_so_naming_the_node() -> None:
    pods = _pods({2: "node-a"})
    lost_pod = pods[2]["metadata"]["name"]
    nodes = {"node-a": _node("node-a", "Unknown", 34), "node-b": _node("node-b", "True", 900)}
    observed, decision = _round(pods, nodes)
    lost = {p.name: p.node_lost for p in observed.pods if p.node_lost}
    assert lost == {lost_pod: "node node-a unreachable (Ready Unknown) for 34s"}
    assert {p.node for p in observed.pods} == {"node-a", "node-b"}
    events = [a for a in decision.actions if isinstance(a, Emit) and a.reason == "NodeLost"]
    assert len(events) == 1 and events[0].type == "Warning"
    assert "node node-a unreachable (Ready Unknown) since 2026-12-01T11:59:26Z" in events[0].message
    assert f"pods {lost_pod} are lost" in events[0].message
    # It stays announced only while not deleting (a deleted pod was announced before).
    assert lost_nodes.node_events(observed)[0] == events[0]
    # Nothing is force-deleted: no one said the node is out of service.
    assert not [
        a for a in decision.actions if isinstance(a, Delete) and a.grace_period_seconds == 0
    ]
    # It looks again to notice an out-of-service taint (which changes no pod).
    assert decision.requeue_after is not None
    assert decision.requeue_after <= lost_nodes.NODE_RECHECK_S


def test_a_finished_pod_is_not_lost_with_its_node() -> None:
    pods = _pods({0: "node-a", 1: "node-a", 2: "node-a"}, {"phase": "Succeeded"})
    observed, _ = _round(pods, {"node-a": _node("node-a", "Unknown", 300)})
    assert [p.node_lost for p in observed.pods] == [None, None, None]


def test_a_not_ready_node_within_its_bound_is_looked_at_again_when_it_ends() -> None:
    pods = _pods({1: "node-a"})
    nodes = {"node-a": _node("node-a", "False", 12), "node-b": _node("node-b", "True", 900)}
    observed, decision = _round(pods, nodes, bound=30.0)
    assert [p.node_lost for p in observed.pods] == [None, None, None]
    assert not [a for a in decision.actions if isinstance(a, Emit) and a.reason == "NodeLost"]
    assert decision.requeue_after is not None and decision.requeue_after <= 18.0
    assert lost_nodes.recheck_after(observed) == pytest.approx(18.0)


def test_pods_on_an_out_of_service_node_are_force_deleted_with_their_uid() -> None:
    pods = _pods({0: "node-a", 2: "node-a"})
    pods[2]["metadata"]["deletionTimestamp"] = "2026-12-01T11:50:00Z"  # stuck Terminating
    on_a = {pods[0]["metadata"]["name"]: "uid-0", pods[2]["metadata"]["name"]: "uid-2"}
    nodes = {
        "node-a": _node("node-a", "Unknown", 600, OUT_OF_SERVICE),
        "node-b": _node("node-b", "True", 900),
    }
    _, decision = _round(pods, nodes)
    pod_deletes = [a for a in decision.actions if isinstance(a, Delete) and a.kind == "Pod"]
    forced = {a.name: a.uid for a in pod_deletes if a.grace_period_seconds == 0}
    assert forced == on_a
    # No plain delete of a pod that is force-deleted goes out beside it.
    assert sorted(a.name for a in pod_deletes if a.name in on_a) == sorted(on_a)
    events = [a.message for a in decision.actions if isinstance(a, Emit) and a.reason == "NodeLost"]
    # Both are pods the job still counts on: the one stuck Terminating is named too.
    assert events == [
        f"node node-a is out of service ({OUT_OF_SERVICE}) (nodeLostSeconds 30): "
        f"pods {pods[0]['metadata']['name']}, {pods[2]['metadata']['name']} are lost"
    ]


def _node_lost_events(actions: tuple[Any, ...]) -> list[str]:
    return [a.message for a in actions if isinstance(a, Emit) and a.reason == "NodeLost"]


@pytest.mark.parametrize("lost", [(0,), (1, 2)], ids=["policy-pod", "rollout-pods"])
def test_pods_the_taint_eviction_deleted_first_are_announced_once(lost: tuple[int, ...]) -> None:
    # kube-controller-manager evicted them (the pods' tolerationSeconds ran out) before the
    # operator's round found the node lost: they are deleting, and nobody announced them.
    pods = _pods(dict.fromkeys(lost, "node-a"))
    evicted = {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}
    for index in lost:
        pods[index]["metadata"]["deletionTimestamp"] = "2026-12-01T11:59:55Z"
        pods[index]["status"] = {**RUNNING, "conditions": [*RUNNING["conditions"], evicted]}
    names = ", ".join(sorted(pods[i]["metadata"]["name"] for i in lost))
    nodes = {"node-a": _node("node-a", "Unknown", 34), "node-b": _node("node-b", "True", 900)}
    _, first = _round(pods, nodes)
    assert _node_lost_events(first.actions) == [
        "node node-a unreachable (Ready Unknown) since 2026-12-01T11:59:26Z "
        f"(nodeLostSeconds 30): pods {names} are lost"
    ]
    # That round replaced them (a new epoch, or the slots' next generation): from its
    # status the job no longer counts on them, and they are not announced again.
    _, second = _round(pods, nodes, status=first.status)
    assert _node_lost_events(second.actions) == []


def test_without_nodes_nothing_is_lost_and_nothing_is_added() -> None:
    pods = _pods({0: "node-a", 1: "node-a", 2: "node-a"})
    observed = observe(pods, [], {})
    assert [p.node_lost for p in observed.pods] == [None, None, None]
    assert lost_nodes.force_deletes(observed) == []
    assert lost_nodes.recheck_after(observed) is None
