"""A role's pod template merged with what the operator owns, and the templates refused
because they set it differently: table-tested through ``render_pod`` (pure).

Real: the models (templates checked against the upstream schema), the renderer, the merge.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from refit_operator.api.models import parse_spec
from refit_operator.render.merge import TemplateConflict
from refit_operator.render.pods import JobRef, RenderOptions, render_pod, template_conflicts

JOB = JobRef(name="job", namespace="ns", uid="u-1", pod_labels={"kueue.x-k8s.io/queue-name": "q"})
OPTIONS = RenderOptions()


def _spec(template: dict[str, Any] | None = None, **role: Any) -> Any:
    policy: dict[str, Any] = {"replicas": 1, **role}
    if template is not None:
        policy["template"] = template
    return parse_spec({"image": "img:1", "policy": policy})


def _pod(template: dict[str, Any] | None = None, **role: Any) -> dict[str, Any]:
    return render_pod(JOB, _spec(template, **role), "policy", 0, epoch=2, options=OPTIONS)


def _with(worker: dict[str, Any] | None = None, **pod: Any) -> dict[str, Any]:
    meta = pod.pop("metadata", None)
    out: dict[str, Any] = {"spec": {**pod, "containers": [{"name": "worker", **(worker or {})}]}}
    if meta is not None:
        out["metadata"] = meta
    return out


GPU_TEMPLATE = _with(
    worker={
        "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
        "ports": [{"name": "metrics", "containerPort": 9090}],
    },
    metadata={"labels": {"team": "rl"}, "annotations": {"k8s.v1.cni.cncf.io/networks": "rdma"}},
    imagePullSecrets=[{"name": "reg"}],
    volumes=[{"name": "shm", "emptyDir": {"medium": "Memory"}}],
    priorityClassName="training",
    schedulerName="my-scheduler",
    runtimeClassName="nvidia",
    nodeSelector={"gpu": "h100"},
    tolerations=[{"key": "gpu", "operator": "Exists"}],
)


def test_everything_the_template_sets_reaches_the_pod_beside_the_operators_parts() -> None:
    pod = _pod(GPU_TEMPLATE)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["labels"]["team"] == "rl" and meta["labels"]["refit.dev/rank"] == "0"
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "q"  # from the job's labels
    assert meta["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma"
    assert "refit.dev/spec-hash" in meta["annotations"]
    assert meta["ownerReferences"][0]["uid"] == "u-1"
    for key in ("imagePullSecrets", "priorityClassName", "schedulerName", "runtimeClassName"):
        assert spec[key] == GPU_TEMPLATE["spec"][key]
    assert spec["nodeSelector"] == {"gpu": "h100"} and spec["tolerations"][0]["key"] == "gpu"
    assert spec["restartPolicy"] == "Never" and spec["hostname"] == "job-policy-0-e2"
    assert spec["serviceAccountName"] == "job-policy-worker"  # the role's, with the secrets
    assert [v["name"] for v in spec["volumes"]] == ["shm", "tmp", "refit-signal"]
    worker = spec["containers"][0]
    assert worker["command"] == ["refit-worker"] and worker["image"] == "img:1"
    names = [e["name"] for e in worker["env"]]
    assert names[-1] == "TOKEN" and all(n.startswith("REFIT_") for n in names[:-1])
    assert worker["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert worker["securityContext"]["allowPrivilegeEscalation"] is False
    assert [p["name"] for p in worker["ports"]] == ["dist", "metrics"]
    assert [m["mountPath"] for m in worker["volumeMounts"]] == [
        "/dev/shm",
        "/tmp",
        "/var/run/refit",
    ]
    assert "preStop" in worker["lifecycle"]


def test_the_template_is_not_changed_and_each_rank_gets_its_own_copy() -> None:
    template = copy.deepcopy(GPU_TEMPLATE)
    spec = _spec(template)
    first = render_pod(JOB, spec, "policy", 0, epoch=0, options=OPTIONS)
    first["spec"]["volumes"].append({"name": "x"})
    again = render_pod(JOB, spec, "policy", 0, epoch=0, options=OPTIONS)
    assert [v["name"] for v in again["spec"]["volumes"]] == ["shm", "tmp", "refit-signal"]
    assert spec.policy.template == GPU_TEMPLATE


@pytest.mark.parametrize(
    ("template", "role", "field"),
    [
        (
            _with(restartPolicy="OnFailure"),
            {},
            "spec.policy.template.spec.restartPolicy: 'OnFailure' conflicts with the operator",
        ),
        (_with(hostname="h"), {}, "spec.policy.template.spec.hostname"),
        (_with(subdomain="s"), {}, "spec.policy.template.spec.subdomain"),
        (
            _with(terminationGracePeriodSeconds=5),
            {},
            "terminationGracePeriodSeconds: 5 conflicts with the operator: set"
            " spec.preemption.gracePeriodSeconds instead",
        ),
        (_with(nodeName="n1"), {}, "spec.policy.template.spec.nodeName"),
        (_with(serviceAccount="old"), {}, "deprecated; use serviceAccountName"),
        (
            _with(schedulingGates=[{"name": "refit.dev/gang"}]),
            {},
            "spec.policy.template.spec.schedulingGates",
        ),
        (_with(volumes=[{"name": "refit-signal", "emptyDir": {}}]), {}, "volumes[0].name"),
        (
            _with(metadata={"labels": {"refit.dev/rank": "9"}}),
            {},
            "spec.policy.template.metadata.labels[refit.dev/rank]",
        ),
        (
            _with(metadata={"labels": {"app.kubernetes.io/managed-by": "me"}}),
            {},
            "metadata.labels[app.kubernetes.io/managed-by]",
        ),
        (
            _with(metadata={"annotations": {"refit.dev/spec-hash": "x"}}),
            {},
            "metadata.annotations[refit.dev/spec-hash]",
        ),
        (
            _with(metadata={"labels": {"kueue.x-k8s.io/queue-name": "other"}}),
            {},
            "metadata.labels[kueue.x-k8s.io/queue-name]",
        ),
        (
            {"spec": {"containers": [{"name": "main"}]}},
            {},
            "spec.policy.template.spec.containers: no container is named 'worker' (got 'main')",
        ),
        (
            _with({"env": [{"name": "REFIT_RANK", "value": "3"}]}),
            {},
            "containers[0].env[0].name: 'REFIT_RANK' is reserved",
        ),
        (
            _with({"env": [{"name": "X", "value": "3"}]}),
            {"env": [{"name": "X", "value": "1"}]},
            "'X' is also set by the role's short form env",
        ),
        (_with({"command": ["a"]}), {"command": ["b"]}, "containers[0].command"),
        (_with({"args": ["a"]}), {"args": ["b"]}, "containers[0].args"),
        (
            _with({"resources": {"limits": {"cpu": 1}}}),
            {"resources": {"limits": {"cpu": 2}}},
            "containers[0].resources",
        ),
        (
            _with({"lifecycle": {"preStop": {"exec": {"command": ["x"]}}}}),
            {},
            "containers[0].lifecycle.preStop",
        ),
        (
            _with({"terminationMessagePolicy": "File"}),
            {},
            "containers[0].terminationMessagePolicy",
        ),
        (_with({"ports": [{"containerPort": 29500}]}), {}, "containers[0].ports[0]"),
        (
            _with({"volumeMounts": [{"name": "cache", "mountPath": "/var/run/refit"}]}),
            {},
            "volumeMounts[0].mountPath: '/var/run/refit' is the operator's",
        ),
    ],
)
def test_a_conflicting_template_is_refused_naming_the_field(
    template: dict[str, Any], role: dict[str, Any], field: str
) -> None:
    with pytest.raises(TemplateConflict) as info:
        _pod(template, **role)
    assert field in str(info.value)
    assert any(field in p for p in template_conflicts(JOB, _spec(template, **role), OPTIONS))


def test_every_conflict_of_a_template_is_named_at_once() -> None:
    template = _with({"env": [{"name": "REFIT_X", "value": "1"}]}, hostname="h", nodeName="n")
    problems = template_conflicts(JOB, _spec(template), OPTIONS)
    assert len(problems) == 3, problems


@pytest.mark.parametrize(
    ("template", "role"),
    [
        (_with(restartPolicy="Never"), {}),  # the operator's own value
        (_with({"command": ["python", "-m", "trainer"]}), {}),  # the worker's command
        (_with({"image": "other:2", "imagePullPolicy": "Always"}), {}),  # per-role image
        (_with({"resources": {"limits": {"nvidia.com/gpu": 1}}}), {}),
        (_with({"lifecycle": {"postStart": {"exec": {"command": ["true"]}}}}), {}),
        (_with({"env": [{"name": "Y", "value": "2"}]}), {"env": [{"name": "X", "value": "1"}]}),
        (_with(schedulingGates=[{"name": "example.com/quota"}]), {}),
        (_with(securityContext={"runAsUser": 2000}), {}),
    ],
)
def test_a_template_that_agrees_with_the_operator_is_merged(
    template: dict[str, Any], role: dict[str, Any]
) -> None:
    pod = _pod(template, **role)
    assert template_conflicts(JOB, _spec(template, **role), OPTIONS) == []
    worker = pod["spec"]["containers"][0]
    if "command" in template["spec"]["containers"][0]:
        assert worker["command"] == ["python", "-m", "trainer"]
    if "image" in template["spec"]["containers"][0]:
        assert (worker["image"], worker["imagePullPolicy"]) == ("other:2", "Always")
    gates = [g["name"] for g in pod["spec"]["schedulingGates"]]
    assert gates[-1] == "refit.dev/gang"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_sidecars_follow_the_worker_which_comes_first() -> None:
    template = {"spec": {"containers": [{"name": "proxy", "image": "p"}, {"name": "worker"}]}}
    pod = _pod(template)
    assert [c["name"] for c in pod["spec"]["containers"]] == ["worker", "proxy"]
    assert pod["spec"]["containers"][1] == {"name": "proxy", "image": "p"}


def test_a_privileged_template_drops_the_escalation_default_only() -> None:
    pod = _pod(_with({"securityContext": {"privileged": True}}))
    context = pod["spec"]["containers"][0]["securityContext"]
    assert context["privileged"] is True and "allowPrivilegeEscalation" not in context
    assert context["capabilities"] == {"drop": ["ALL"]}


def test_a_named_service_account_is_kept_and_bound() -> None:
    from refit_operator.render.children import render_rbac

    spec = _spec(_with(serviceAccountName="trainer"))
    pod = render_pod(JOB, spec, "policy", 0, epoch=0, options=OPTIONS)
    assert pod["spec"]["serviceAccountName"] == "trainer"
    bindings = {
        o["metadata"]["labels"]["refit.dev/role"]: o["subjects"]
        for o in render_rbac(JOB, spec)
        if o["kind"] == "RoleBinding"
    }
    # The policy role's Role binds the named account; the rollout role keeps its own.
    assert [s["name"] for s in bindings["policy"]] == ["trainer"]
    assert [s["name"] for s in bindings["rollout"]] == ["job-rollout-worker"]
    only_named = parse_spec(
        {
            "image": "i",
            "policy": {"template": _with(serviceAccountName="trainer")},
            "rollout": {"template": _with(serviceAccountName="trainer")},
        }
    )
    objs = render_rbac(JOB, only_named)
    assert "ServiceAccount" not in {o["kind"] for o in objs}  # nobody uses a role's own one
    subjects = [o["subjects"] for o in objs if o["kind"] == "RoleBinding"]
    assert subjects == [[{"kind": "ServiceAccount", "name": "trainer", "namespace": "ns"}]] * 2
