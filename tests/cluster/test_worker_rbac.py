"""RBAC for real: a rollout pod's ServiceAccount token (requested by its node through the
TokenRequest API, bound to the pod) reads its own job's rendezvous maps and patches only
its own role's; the apiserver answers 403 to everything beyond — the operator's map (the
barrier, the preemption notice), the policy role's entries, another job's maps.

Real: the apiserver's authentication of bound service-account tokens and its RBAC
authorizer, the per-role Role and RoleBinding the operator created, the worker that ran.
"""

from __future__ import annotations

import pytest
import yaml
from tests.cluster.rest import ApiError, Rest
from tests.cluster.support import Cluster, Install, example

NS = "rbac"


def _expect_403(call: object, what: str) -> None:
    with pytest.raises(ApiError) as info:
        call()  # type: ignore[operator]
    assert info.value.status == 403, f"{what}: {info.value}"
    assert "forbidden" in info.value.message, info.value.message


def test_worker_token_reaches_its_own_configmap_only(cluster: Cluster, install: Install) -> None:
    cluster.namespace(NS)
    own = example("local", metadata={"name": "own", "namespace": NS})
    own["spec"]["transfer"]["refits"] = 1
    other = example("local", metadata={"name": "other", "namespace": NS})
    # Its ConfigMap and RBAC exist; its pods wait for a node that never comes.
    nowhere = {"nodeSelector": {"refit.dev/test-no-such-node": "true"}}
    for role in ("policy", "rollout"):
        other["spec"][role]["template"] = {"spec": {**nowhere, "containers": [{"name": "worker"}]}}
    cluster.kubectl.apply([own, other])
    cluster.kubectl.ok("wait", "--for=condition=Complete", "rj/own", "-n", NS, "--timeout=300s")
    # A rollout rank: Succeeded pods stay (their bound tokens with them) after the job ends.
    pod = cluster.pods(NS, "refit.dev/job=own,refit.dev/role=rollout")[0]
    config = yaml.safe_load(cluster.pod_kubeconfig(pod["metadata"]["uid"]).read_text())
    token = config["users"][0]["user"]["token"]
    as_pod = Rest(cluster.plane.server, token, cluster.plane.ca_file)
    review = as_pod.post(
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
    )
    info = review["status"]["userInfo"]
    assert info["username"] == f"system:serviceaccount:{NS}:own-rollout-worker"
    assert info["extra"]["authentication.kubernetes.io/pod-uid"] == [pod["metadata"]["uid"]]

    maps = f"/api/v1/namespaces/{NS}/configmaps"
    assert as_pod.get(f"{maps}/own-rendezvous")["metadata"]["name"] == "own-rendezvous"
    assert as_pod.get(f"{maps}/own-rendezvous-policy")["metadata"]["name"]  # peers' metadata
    patched = as_pod.patch(f"{maps}/own-rendezvous-rollout", {"data": {"rbac-test": "1"}})
    assert patched["data"]["rbac-test"] == "1"
    _expect_403(
        lambda: as_pod.patch(f"{maps}/own-rendezvous", {"data": {"barrier": "{}"}}),
        "patching the operator's map (the barrier)",
    )
    _expect_403(
        lambda: as_pod.patch(f"{maps}/own-rendezvous-policy", {"data": {"meta.policy.0": "{}"}}),
        "patching the policy role's entries",
    )
    _expect_403(lambda: as_pod.get(f"{maps}/other-rendezvous"), "another job's ConfigMap")
    _expect_403(
        lambda: as_pod.patch(f"{maps}/other-rendezvous", {"data": {"x": "1"}}),
        "patching another job's ConfigMap",
    )
    _expect_403(lambda: as_pod.get(maps), "listing ConfigMaps")
    _expect_403(
        lambda: as_pod.delete(f"{maps}/own-rendezvous-rollout"), "deleting its own ConfigMap"
    )
    _expect_403(lambda: as_pod.get(f"/api/v1/namespaces/{NS}/secrets"), "Secrets")
    _expect_403(lambda: as_pod.get(f"/api/v1/namespaces/{NS}/pods"), "pods")
    _expect_403(lambda: as_pod.get("/apis/refit.dev/v1alpha1/refitjobs"), "RefitJobs")
    # kubectl agrees, through the pod's own kubeconfig.
    kubeconfig = cluster.pod_kubeconfig(pod["metadata"]["uid"])
    can = cluster.kubectl.run("auth", "can-i", "get", "secrets", "-n", NS, kubeconfig=kubeconfig)
    assert can.stdout.strip() == "no"
    cluster.kubectl.ok("delete", "rj", "own", "other", "-n", NS, "--wait=true", "--timeout=120s")
