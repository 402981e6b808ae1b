"""Gang admission as rendered objects (pure): the scheduling gate on every pod, or a
PodGroup for Volcano or the scheduler-plugins coscheduling plugin with its pods naming it
the way each scheduler reads it.  No gang scheduler runs in the tests: this is the contract
they read (``docs/cluster.md`` says which to use when); the chart's RBAC for PodGroups is
checked in ``tests/integration/test_chart_rbac.py`` (every kind in ``kube.PLURALS``).

Real: the models, the renderers, the reconcile.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from refit_operator.api.models import Phase, RefitJobStatus, parse_spec
from refit_operator.apply.applier import creation_waves
from refit_operator.core.decision import Delete, JobView
from refit_operator.core.observe import observe
from refit_operator.core.reconcile import reconcile
from refit_operator.render import gang
from refit_operator.render.pods import JobRef, RenderOptions, render_gang
from refit_operator.shell import kube

JOB = JobRef(name="job", namespace="ns", uid="u-1")
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _gang(admission: dict[str, Any], epoch: int = 4, **role: Any) -> list[dict[str, Any]]:
    spec = parse_spec(
        {
            "image": "i",
            "policy": {"replicas": 2, **role},
            "rollout": {"replicas": 3},
            "gang": admission,
        }
    )
    return render_gang(JOB, spec, epoch, RenderOptions())


def test_scheduling_gates_hold_every_pod_and_no_group_is_made() -> None:
    objs = _gang({})  # the default
    assert [o["kind"] for o in objs] == ["Pod"] * 5
    for pod in objs:
        assert pod["spec"]["schedulingGates"] == [{"name": gang.GATE}]
        assert "schedulerName" not in pod["spec"]


def test_a_volcano_pod_group_with_the_gang_as_min_member() -> None:
    objs = _gang({"admission": "PodGroup", "podGroup": {"queue": "gpu"}})
    group, pods = objs[0], objs[1:]
    assert group == {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "PodGroup",
        "metadata": {
            "name": "job-gang-4",
            "namespace": "ns",
            "labels": {
                "refit.dev/job": "job",
                "app.kubernetes.io/managed-by": "refit-operator",
                "refit.dev/epoch": "4",
            },
            "ownerReferences": pods[0]["metadata"]["ownerReferences"],
        },
        "spec": {"minMember": 5, "queue": "gpu"},
    }
    for pod in pods:
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "job-gang-4"
        assert pod["spec"]["schedulerName"] == "volcano"
        assert "schedulingGates" not in pod["spec"]


def test_a_coscheduling_pod_group_and_a_scheduler_named_in_the_template() -> None:
    template = {"spec": {"schedulerName": "my-cosched", "containers": [{"name": "worker"}]}}
    objs = _gang(
        {
            "admission": "PodGroup",
            "podGroup": {"scheduler": "Coscheduling", "scheduleTimeoutSeconds": 60},
        },
        template=template,
    )
    group = objs[0]
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"] == {"minMember": 5, "scheduleTimeoutSeconds": 60}
    names = {p["spec"]["schedulerName"] for p in objs[1:]}
    # The template's scheduler for its role; the coscheduling default for the other.
    assert names == {"my-cosched", "scheduler-plugins-scheduler"}
    for pod in objs[1:]:
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "job-gang-4"


def test_the_group_is_created_before_its_pods_and_the_operator_may_write_it() -> None:
    waves = creation_waves(_gang({"admission": "PodGroup"}))
    assert [w[0]["kind"] for w in waves] == ["PodGroup", "Pod"]
    for api_version, _kind in gang.POD_GROUP_KINDS:
        assert kube.PLURALS[(api_version, "PodGroup")] == "podgroups"


@pytest.mark.parametrize("scheduler", ["Volcano", "Coscheduling"])
def test_a_restart_drops_the_old_epochs_group(scheduler: str) -> None:
    raw = {
        "image": "i",
        "policy": {"replicas": 1},
        "rollout": {"replicas": 1},
        "gang": {"admission": "PodGroup", "podGroup": {"scheduler": scheduler}},
        "failurePolicy": {"maxRestarts": 2},
    }
    pods = [p for p in render_gang(JOB, parse_spec(raw), 0, RenderOptions()) if p["kind"] == "Pod"]
    for pod in pods:
        pod["metadata"]["uid"] = "uid-" + pod["metadata"]["name"]
        pod["status"] = {"phase": "Failed"}
    view = JobView(JOB, 1, raw, RefitJobStatus(phase=Phase.RUNNING, created_epoch=0))
    d = reconcile(view, observe(pods, []), NOW, RenderOptions())
    groups = [a for a in d.actions if isinstance(a, Delete) and a.kind == "PodGroup"]
    assert [(g.api_version, g.name) for g in groups] == [
        (gang.pod_group_api(parse_spec(raw).gang), "job-gang-0")
    ]
