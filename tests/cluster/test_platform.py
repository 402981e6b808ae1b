"""A RefitJob as a GPU platform team runs it, against the real control plane: pod templates,
gang admission by scheduling gates, the Kueue contract, lifetimes, and the apiserver's
refusals in the job's own status.

- the CRD embeds the PodTemplateSpec schema this very apiserver serves;
- a template with pull secrets, a /dev/shm volume, labels and annotations, env from a
  Secret and IPC_LOCK reaches the pods (and the processes), with the per-job account for
  one role and a ServiceAccount of the user's for the other, bound to the rendezvous;
- a template that conflicts with the operator is refused, naming the fields;
- ``nvidia.com/gpu: 1`` unquoted is stored, ``8 GB`` is refused at apply time;
- a gang held by its scheduling gate while a ResourceQuota refuses one pod (the 403 in the
  status, a condition and an Event), released as a whole once the quota allows it;
- a ValidatingAdmissionPolicy's denial (HTTP 422) fails the job with the policy's words;
- ``ttlSecondsAfterFinished: 5``: the job and every child gone after it ends;
- an unpullable image, and a pod no node can take, fail the epoch within the start
  deadline with ImagePullBackOff, or Unschedulable and the scheduler's message;
- a suspended, Kueue-labelled job creates nothing until ``suspend: false``; a job another
  controller manages (``managedBy``) is left alone, and ``managedBy`` cannot change.

No real Kueue, Volcano or coscheduling plugin runs here: what is tested is the contract they
rely on (suspend, labels on pods, managedBy); the PodGroups are checked as rendered objects
in ``tests/unit/test_gang.py``.

Real: the apiserver (schema, CEL, quota, admission policy, RBAC), kube-scheduler, the
garbage collector, kubectl, the operator, the workers.  Played: the kubelet (process nodes:
the ``.invalid`` registry is their unpullable image).
"""

from __future__ import annotations

import base64
import json
import sys
import time
from typing import Any

import pytest
from tests.cluster.pod_template_schema import TARGET, render, served
from tests.cluster.support import Cluster, Install, elapsed, example, wait

from refit_operator.api import names

NS = "platform"
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]
CHILD_PATHS = {
    "pods": "/api/v1/namespaces/{ns}/pods",
    "services": "/api/v1/namespaces/{ns}/services",
    "configmaps": "/api/v1/namespaces/{ns}/configmaps",
    "serviceaccounts": "/api/v1/namespaces/{ns}/serviceaccounts",
    "roles": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "rolebindings": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
}


@pytest.fixture(scope="module")
def ns(cluster: Cluster) -> str:
    return cluster.namespace(NS)


def children(cluster: Cluster, job: str, namespace: str = NS) -> dict[str, list[str]]:
    """Name of every child of ``job`` by kind (labelled refit.dev/job)."""
    out = {}
    for kind, path in CHILD_PATHS.items():
        items = cluster.rest.get(path.format(ns=namespace), labelSelector=f"refit.dev/job={job}")
        out[kind] = sorted(o["metadata"]["name"] for o in items["items"])
    return out


def events(cluster: Cluster, job: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.kubectl.json("get", "events", "-n", NS)["items"]
    return [e for e in items if e["involvedObject"]["name"] == job]


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def final(cluster: Cluster, job: str, timeout: float = 120) -> dict[str, Any]:
    status: dict[str, Any] = wait(
        lambda: (s := cluster.job_status(NS, job)).get("phase") in ("Succeeded", "Failed") and s,
        f"job {job} to end",
        timeout=timeout,
    )
    return status


def delete(cluster: Cluster, *jobs: str) -> None:
    cluster.kubectl.ok("delete", "rj", *jobs, "-n", NS, "--wait=true", "--timeout=120s")


def template(**pod: Any) -> dict[str, Any]:
    worker = {"name": "worker", **pod.pop("worker", {})}
    meta = pod.pop("metadata", None)
    out: dict[str, Any] = {"spec": {**pod, "containers": [worker]}}
    if meta is not None:
        out["metadata"] = meta
    return out


def test_the_crd_embeds_the_pod_template_this_apiserver_serves(cluster: Cluster) -> None:
    # The checked-in schema (crds/refitjob.yaml embeds it) is the conversion of what the
    # tier's kube-apiserver serves: regenerate with `python -m tests.cluster.pod_template_schema`.
    assert TARGET.read_text() == render(served(cluster.rest))


def test_a_template_reaches_the_pods(cluster: Cluster, install: Install, ns: str) -> None:
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "hf-token", "namespace": NS},
        "data": {"token": base64.b64encode(b"s3cret").decode()},
    }
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "trainer", "namespace": NS},
    }
    cluster.kubectl.apply([secret, account])
    job = example("local", metadata={"name": "shaped", "namespace": NS})
    job["spec"]["transfer"]["refits"] = 1
    gpu_pod = template(
        metadata={"labels": {"team": "rl"}, "annotations": {"k8s.v1.cni.cncf.io/networks": "rdma"}},
        imagePullSecrets=[{"name": "regcred"}],
        volumes=[{"name": "shm", "emptyDir": {"medium": "Memory"}}],
        worker={
            "env": [
                {
                    "name": "HF_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
                }
            ],
            "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
            "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
        },
    )
    job["spec"]["rollout"]["template"] = gpu_pod
    job["spec"]["policy"]["template"] = json.loads(json.dumps(gpu_pod))
    job["spec"]["policy"]["template"]["spec"]["serviceAccountName"] = "trainer"
    job["spec"]["rollout"]["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    cluster.kubectl.apply(job)
    cluster.kubectl.ok("wait", "--for=condition=Complete", "rj/shaped", "-n", NS, "--timeout=300s")
    pods = cluster.pods(NS, "refit.dev/job=shaped")
    assert len(pods) == 4
    for pod in pods:
        meta, spec = pod["metadata"], pod["spec"]
        worker = spec["containers"][0]
        assert worker["name"] == "worker"
        assert meta["labels"]["team"] == "rl" and meta["labels"]["refit.dev/job"] == "shaped"
        assert meta["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma"
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        assert {"name": "shm", "emptyDir": {"medium": "Memory"}} in spec["volumes"]
        assert {"name": "shm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
        caps = worker["securityContext"]["capabilities"]
        assert caps == {"add": ["IPC_LOCK"], "drop": ["ALL"]}
        assert {
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
        } in worker["env"]
        assert not spec.get("schedulingGates")  # lifted once the gang existed
        role = meta["labels"]["refit.dev/role"]
        assert spec["serviceAccountName"] == _SHAPED_ACCOUNTS[role]
        if role == "rollout":
            assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
        # The node resolved the Secret into the process's environment, as a kubelet does.
        env = next(n.envs[meta["uid"]] for n in cluster.nodes.values() if meta["uid"] in n.envs)
        assert env["HF_TOKEN"] == "s3cret"
    bindings = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings"
    for role, account in _SHAPED_ACCOUNTS.items():
        binding = cluster.rest.get(f"{bindings}/{names.worker_account_name('shaped', role)}")
        assert [s["name"] for s in binding["subjects"]] == [account], (role, binding)
    delete(cluster, "shaped")


#: The account each role's pods of job "shaped" run as: the one its template names (the
#: policy role), else the role's own.  Each role's Role is bound to that one alone.
_SHAPED_ACCOUNTS = {"policy": "trainer", "rollout": names.worker_account_name("shaped", "rollout")}


def test_a_conflicting_template_is_refused_naming_the_fields(
    cluster: Cluster, install: Install, ns: str
) -> None:
    job = example("local", metadata={"name": "clash", "namespace": NS})
    job["spec"]["policy"]["template"] = template(
        restartPolicy="OnFailure",
        worker={
            "env": [{"name": "REFIT_RANK", "value": "7"}],
            "lifecycle": {"preStop": {"exec": {"command": ["true"]}}},
        },
    )
    cluster.kubectl.apply(job)
    status = final(cluster, "clash", timeout=30)
    assert (
        status["phase"] == "Failed" and condition(status, "Failed")["reason"] == "TemplateConflict"
    )
    for field in (
        "spec.policy.template.spec.restartPolicy",
        "spec.policy.template.spec.containers[0].env[0].name: 'REFIT_RANK' is reserved",
        "spec.policy.template.spec.containers[0].lifecycle.preStop",
    ):
        assert field in status["message"], status["message"]
    assert children(cluster, "clash")["pods"] == []
    assert "TemplateConflict" in {e["reason"] for e in events(cluster, "clash")}
    delete(cluster, "clash")


QUANTITY_JOB = """
apiVersion: refit.dev/v1alpha1
kind: RefitJob
metadata: {{name: quantities, namespace: {ns}}}
spec:
  image: img:1
  policy:
    resources:
      limits: {{nvidia.com/gpu: {short}}}
  rollout:
    template:
      spec:
        containers:
          - name: worker
            resources:
              limits: {{nvidia.com/gpu: 1, memory: {memory}}}
"""


def test_quantities_unquoted_accepted_and_8_gb_refused_at_apply(
    cluster: Cluster, install: Install, ns: str
) -> None:
    good = QUANTITY_JOB.format(ns=NS, short=1, memory="8Gi")
    assert "quantities created (server dry run)" in cluster.kubectl.ok(
        "apply", "--dry-run=server", "-f", "-", stdin=good
    )
    for short, memory, field in (
        ('"8 GB"', "8Gi", "spec.policy.resources.limits.nvidia.com/gpu"),
        (1, '"8 GB"', "spec.rollout.template.spec.containers[0].resources.limits.memory"),
    ):
        done = cluster.kubectl.run(
            "apply", "-f", "-", stdin=QUANTITY_JOB.format(ns=NS, short=short, memory=memory)
        )
        assert done.returncode != 0 and field in done.stderr and "8 GB" in done.stderr, done.stderr
    assert (
        cluster.rest.find(f"/apis/refit.dev/v1alpha1/namespaces/{NS}/refitjobs/quantities") is None
    )


def test_gates_hold_the_gang_while_a_quota_refuses_a_pod_then_release_it_whole(
    cluster: Cluster, install: Install, ns: str
) -> None:
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "pods", "namespace": NS},
        "spec": {"hard": {"pods": "3"}},
    }
    cluster.kubectl.apply(quota)
    wait(
        lambda: (
            cluster.rest.get(f"/api/v1/namespaces/{NS}/resourcequotas/pods").get("status") or {}
        ).get("hard"),
        "the quota controller to publish the quota",
        timeout=30,
    )
    job = example("local", metadata={"name": "gated", "namespace": NS})
    for role in ("policy", "rollout"):
        job["spec"][role]["command"] = SLEEP
    cluster.kubectl.apply(job)
    status = wait(
        lambda: (
            (s := cluster.job_status(NS, "gated"))
            and condition(s, "ChildFailure").get("status") == "True"
            and s
        ),
        "the quota's refusal in the job's status",
        timeout=30,
    )
    failure = condition(status, "ChildFailure")
    assert failure["reason"] == "Forbidden" and "exceeded quota" in failure["message"], failure
    assert "exceeded quota" in status["message"] and status["phase"] == "Pending"
    warned = [e for e in events(cluster, "gated") if e["reason"] == "FailedCreate"]
    assert warned and warned[0]["type"] == "Warning" and "exceeded quota" in warned[0]["message"]
    # Three of four pods exist: all held at the gate, none placed, for as long as it lasts.
    for _ in range(10):
        pods = cluster.pods(NS, "refit.dev/job=gated")
        assert len(pods) == 3
        assert all(p["spec"]["schedulingGates"] == [{"name": "refit.dev/gang"}] for p in pods)
        assert not any(p["spec"].get("nodeName") for p in pods)
        time.sleep(0.3)
    cluster.kubectl.ok(
        "patch", "resourcequota", "pods", "-n", NS, "-p", '{"spec":{"hard":{"pods":"20"}}}'
    )
    started = time.monotonic()
    wait(
        lambda: (
            len(pods := cluster.pods(NS, "refit.dev/job=gated")) == 4
            and all(p["spec"].get("nodeName") for p in pods)
        ),
        "the whole gang placed once the quota allows the fourth pod",
        timeout=60,
    )
    cluster.kubectl.ok(
        "wait", "rj/gated", "-n", NS, "--for=jsonpath={.status.phase}=Running", "--timeout=60s"
    )
    status = cluster.job_status(NS, "gated")
    assert condition(status, "ChildFailure")["status"] == "False" and status["message"] == ""
    print(f"gang placed {elapsed(started)} s after the quota was raised")
    delete(cluster, "gated")
    cluster.kubectl.ok("delete", "resourcequota", "pods", "-n", NS)


def test_an_admission_policy_denial_fails_the_job_with_its_words(
    cluster: Cluster, install: Install, ns: str
) -> None:
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": "no-untrusted-pods"},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                    }
                ]
            },
            "validations": [
                {
                    "expression": "!has(object.metadata.labels)"
                    " || !('untrusted' in object.metadata.labels)",
                    "message": "pods labelled untrusted are not allowed here",
                }
            ],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": "no-untrusted-pods"},
        "spec": {
            "policyName": "no-untrusted-pods",
            "validationActions": ["Deny"],
            "matchResources": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NS}}
            },
        },
    }
    cluster.kubectl.apply([policy, binding])
    try:
        # A policy takes effect a moment after it is stored: wait until it denies a pod.
        probe = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "probe", "namespace": NS, "labels": {"untrusted": "yes"}},
            "spec": {"containers": [{"name": "c", "image": "i"}]},
        }
        wait(
            lambda: (
                cluster.kubectl.run(
                    "create", "--dry-run=server", "-f", "-", stdin=json.dumps(probe)
                ).returncode
                != 0
            ),
            "the admission policy to deny a labelled pod",
            timeout=60,
        )
        job = example("local", metadata={"name": "denied", "namespace": NS})
        job["spec"]["rollout"]["template"] = template(metadata={"labels": {"untrusted": "yes"}})
        cluster.kubectl.apply(job)
        status = final(cluster, "denied", timeout=60)
        assert status["phase"] == "Failed", status
        assert condition(status, "Failed")["reason"] == "ChildRejected"
        message = status["message"]
        assert "create Pod denied-rollout-" in message and "HTTP 422" in message, message
        assert "pods labelled untrusted are not allowed here" in message
        (warning,) = [e for e in events(cluster, "denied") if e["reason"] == "ChildRejected"]
        assert warning["type"] == "Warning" and "not allowed here" in warning["message"]
        wait(
            lambda: not cluster.pods(NS, "refit.dev/job=denied"), "the refused job's pods to go", 60
        )
    finally:
        cluster.kubectl.run("delete", "rj", "denied", "-n", NS, "--wait=true", "--timeout=60s")
        cluster.kubectl.ok(
            "delete",
            "validatingadmissionpolicybinding,validatingadmissionpolicy",
            "no-untrusted-pods",
        )


def test_ttl_after_finished_deletes_the_job_and_every_child(
    cluster: Cluster, install: Install, ns: str
) -> None:
    job = example("local", metadata={"name": "brief", "namespace": NS})
    job["spec"]["policy"]["command"] = [sys.executable, "-c", "import sys; sys.exit(1)"]
    job["spec"]["failurePolicy"] = {"maxRestarts": 0}
    job["spec"]["ttlSecondsAfterFinished"] = 5
    cluster.kubectl.apply(job)
    status = final(cluster, "brief")
    assert status["phase"] == "Failed"
    had = children(cluster, "brief")
    assert all(
        had[k]
        for k in ("pods", "services", "configmaps", "serviceaccounts", "roles", "rolebindings")
    ), had
    ended = time.monotonic()
    wait(
        lambda: (
            cluster.rest.find(f"/apis/refit.dev/v1alpha1/namespaces/{NS}/refitjobs/brief") is None
        ),
        "the job to be deleted 5 s after it ended",
        timeout=60,
    )
    gone_after = elapsed(ended)
    wait(
        lambda: not any(children(cluster, "brief").values()),
        f"the garbage collector to take {had}",
        60,
    )
    assert gone_after >= 3.0, gone_after  # not before its TTL (the status write took ~1-2 s)


def test_the_start_deadline_fails_an_epoch_that_cannot_pull_or_be_placed(
    cluster: Cluster, install: Install, ns: str
) -> None:
    unpullable = example("local", metadata={"name": "nopull", "namespace": NS})
    unpullable["spec"]["image"] = "registry.invalid/kube-refit:0.1.0"
    unplaceable = example("local", metadata={"name": "noroom", "namespace": NS})
    unplaceable["spec"]["rollout"]["resources"] = {"limits": {"nvidia.com/gpu": 64}}
    for job in (unpullable, unplaceable):
        job["spec"]["startDeadlineSeconds"] = 8
        job["spec"]["failurePolicy"] = {"maxRestarts": 0}
    started = time.monotonic()
    cluster.kubectl.apply([unpullable, unplaceable])
    pulled, placed = final(cluster, "nopull", 60), final(cluster, "noroom", 60)
    took = elapsed(started)
    for status in (pulled, placed):
        assert status["phase"] == "Failed", status
        assert "did not start within startDeadlineSeconds (8 s)" in status["message"]
        assert condition(status, "Failed")["reason"] == "StartDeadlineExceeded"
    assert "ImagePullBackOff" in pulled["message"] and "registry.invalid" in pulled["message"]
    assert "Unschedulable" in placed["message"], placed["message"]
    assert "Insufficient nvidia.com/gpu" in placed["message"], placed["message"]  # the scheduler's
    assert took < 8 + 20, took
    delete(cluster, "nopull", "noroom")


def test_a_suspended_kueue_job_creates_nothing_until_admitted(
    cluster: Cluster, install: Install, ns: str
) -> None:
    job = example("local", metadata={"name": "queued", "namespace": NS})
    job["metadata"]["labels"] = {
        "kueue.x-k8s.io/queue-name": "team-a",
        "kueue.x-k8s.io/priority-class": "high",
    }
    job["spec"]["suspend"] = True
    cluster.kubectl.apply(job)
    cluster.kubectl.ok(
        "wait", "rj/queued", "-n", NS, "--for=jsonpath={.status.phase}=Suspended", "--timeout=30s"
    )
    for _ in range(6):  # the operator has reconciled it (phase Suspended); still nothing
        assert not any(children(cluster, "queued").values()), children(cluster, "queued")
        time.sleep(0.5)
    # Admission: whatever admits it (Kueue, MultiKueue, AppWrapper) clears suspend.
    cluster.kubectl.ok(
        "patch", "rj", "queued", "-n", NS, "--type=merge", "-p", '{"spec":{"suspend":false}}'
    )
    pods = wait(
        lambda: len(pods := cluster.pods(NS, "refit.dev/job=queued")) == 4 and pods,
        "the admitted job's gang",
        timeout=30,
    )
    for pod in pods:
        labels = pod["metadata"]["labels"]
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
        assert labels["kueue.x-k8s.io/priority-class"] == "high"
    delete(cluster, "queued")


def test_a_job_another_controller_manages_is_left_alone(
    cluster: Cluster, install: Install, ns: str
) -> None:
    job = example("local", metadata={"name": "elsewhere", "namespace": NS})
    job["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"
    cluster.kubectl.apply(job)
    time.sleep(3)  # the operator sees it at once: nothing of it may appear
    stored = cluster.rest.get(f"/apis/refit.dev/v1alpha1/namespaces/{NS}/refitjobs/elsewhere")
    assert "status" not in stored and not stored["metadata"].get("finalizers"), stored
    assert not any(children(cluster, "elsewhere").values())
    # managedBy is immutable (the CRD's transition rule, enforced by the apiserver).
    done = cluster.kubectl.run(
        "patch", "rj", "elsewhere", "-n", NS, "--type=merge", "-p", '{"spec":{"managedBy":null}}'
    )
    assert done.returncode != 0 and "managedBy is immutable" in done.stderr, done.stderr
    delete(cluster, "elsewhere")
