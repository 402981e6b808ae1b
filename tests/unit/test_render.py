"""Renderers: golden manifests from a typed spec, no API involved (pure)."""

from __future__ import annotations

import base64
from typing import Any

from refit_operator.api.models import parse_spec
from refit_operator.apply import fresh_key
from refit_operator.render import signing_key
from refit_operator.render.children import (
    render_rbac,
    render_rendezvous,
    render_service,
    render_static,
)
from refit_operator.render.pods import JobRef, RenderOptions, render_gang, render_pod, spec_hash
from refit_worker.contract.config import WorkerConfig
from refit_worker.engine.messages.signing import RefitSigner

JOB = JobRef(name="job", namespace="ns", uid="u-1")
OWNER = [
    {
        "apiVersion": "refit.dev/v1alpha1",
        "kind": "RefitJob",
        "name": "job",
        "uid": "u-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }
]
LABELS = {"refit.dev/job": "job", "app.kubernetes.io/managed-by": "refit-operator"}


def _spec(**overrides: Any) -> Any:
    raw: dict[str, Any] = {
        "image": "img:1",
        "policy": {"replicas": 2},
        "rollout": {"replicas": 1, "env": [{"name": "X", "value": "1"}]},
        "weights": {"synthetic": {"layers": 1, "hidden": 8, "vocab": 16}},
        "transfer": {"bucketSize": "1Mi", "refits": 2},
        "preemption": {"signal": "SIGUSR1", "injection": "stopSignal", "gracePeriodSeconds": 40},
    }
    raw.update(overrides)
    return parse_spec(raw)


def _value(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


GOLDEN_POD: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {
        "name": "job-rollout-0-g2",
        "namespace": "ns",
        "labels": {
            **LABELS,
            "refit.dev/role": "rollout",
            "refit.dev/rank": "0",
            "refit.dev/epoch": "3",
            "refit.dev/generation": "2",
        },
        "ownerReferences": OWNER,
        "annotations": {"refit.dev/spec-hash": "17acce60f98b52bd"},
    },
    "spec": {
        "restartPolicy": "Never",
        "hostname": "job-rollout-0-g2",
        "subdomain": "job-rollout",
        "terminationGracePeriodSeconds": 40,
        "serviceAccountName": "job-rollout-worker",
        "os": {"name": "linux"},
        # Held until every pod of the epoch exists (gang.admission: SchedulingGates).
        "schedulingGates": [{"name": "refit.dev/gang"}],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": "worker",
                "image": "img:1",
                "imagePullPolicy": "IfNotPresent",
                "command": ["refit-worker"],
                "env": [
                    _value("REFIT_EPOCH", "3"),
                    _value("REFIT_FIRST_REFIT", "0"),
                    _value("REFIT_GENERATION", "2"),
                    # Half the grace period: a drained replica waits this long at most
                    # for its replacement to seed from it.
                    _value("REFIT_HAND_OVER_SECONDS", "20.0"),
                    _value("REFIT_JOB", "job"),
                    _value("REFIT_MASTER_ADDR", "job-rollout-0-g2.job-rollout.ns.svc"),
                    _value("REFIT_MASTER_PORT", "29500"),
                    _field("REFIT_NAMESPACE", "metadata.namespace"),
                    _field("REFIT_POD_NAME", "metadata.name"),
                    _field("REFIT_POD_UID", "metadata.uid"),
                    _value("REFIT_POLICY_WORLD_SIZE", "2"),
                    _value("REFIT_PREEMPTION_SIGNAL", "SIGUSR1"),
                    _value("REFIT_RANK", "0"),
                    _value(
                        "REFIT_RENDEZVOUS",
                        '{"location":"job-rendezvous","shards":3,"store":"configmap"}',
                    ),
                    _value("REFIT_ROLE", "rollout"),
                    _value("REFIT_ROLLOUT_WORLD_SIZE", "1"),
                    _value("REFIT_SIGNAL_PID_DIR", ""),
                    _value("REFIT_TERMINATION_MESSAGE_PATH", "/dev/termination-log"),
                    _value(
                        "REFIT_TRANSFER",
                        '{"backend":"UCX","backend_params":{},"bucket_size":1048576,'
                        '"checksum":true,"device":"cpu","refits":2,"release_after_refit":false,'
                        '"shard_expert_weights":false,"timeout_seconds":120.0}',
                    ),
                    _value(
                        "REFIT_WEIGHTS",
                        '{"dtype":"bfloat16","experts":0,"hidden":8,"kind":"synthetic",'
                        '"layers":1,"seed":0,"vocab":16}',
                    ),
                    # The public half of the job's key only: the kubelet reads it.
                    {
                        "name": "REFIT_VERIFY_KEY",
                        "valueFrom": {
                            "secretKeyRef": {"name": "job-signing", "key": "ed25519.pub"}
                        },
                    },
                    _value("X", "1"),
                ],
                "ports": [{"name": "dist", "containerPort": 29500, "protocol": "TCP"}],
                "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                    "readOnlyRootFilesystem": True,
                    "runAsNonRoot": True,
                },
                "lifecycle": {"stopSignal": "SIGUSR1"},
                # The root filesystem is read-only: scratch files go here.
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            }
        ],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    },
}


def test_pod_golden_with_stop_signal() -> None:
    # Rollout rank 0's third generation, created while the policy epoch was 3.
    pod = render_pod(JOB, _spec(), "rollout", 0, epoch=3, generation=2, options=RenderOptions())
    assert pod == GOLDEN_POD


def test_pod_env_is_read_back_by_the_worker() -> None:
    pod = render_pod(JOB, _spec(), "policy", 1, epoch=0, options=RenderOptions())
    env = pod["spec"]["containers"][0]["env"]
    downward = {
        "metadata.name": "job-policy-1-e0",
        "metadata.uid": "uid-9",
        "metadata.namespace": "ns",
    }
    environ = {
        e["name"]: e.get(
            "value", downward.get(e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", ""))
        )
        for e in env
    }
    config = WorkerConfig.from_env(environ)
    assert (config.role, config.rank, config.world_size) == ("policy", 1, 2)
    assert (config.pod_name, config.pod_uid) == ("job-policy-1-e0", "uid-9")
    assert config.transfer.bucket_size == 1 << 20
    assert config.rendezvous.location == "job-rendezvous"
    assert config.master_addr == "job-policy-0-e0.job-policy.ns.svc"


def test_only_policy_pods_get_the_private_half_of_the_jobs_key() -> None:
    secret = fresh_key.with_fresh_key(signing_key.render_secret("job", "ns"))
    assert secret["immutable"] is True and set(secret["data"]) == {"ed25519.key", "ed25519.pub"}
    assert fresh_key.with_fresh_key(signing_key.render_secret("job", "ns")) != secret
    configs = {}
    for role in ("policy", "rollout"):
        pod = render_pod(JOB, _spec(), role, 0, epoch=0, options=RenderOptions())
        env = pod["spec"]["containers"][0]["env"]
        refs = [e for e in env if "secretKeyRef" in e.get("valueFrom", {})]
        assert [r["valueFrom"]["secretKeyRef"]["name"] for r in refs] == ["job-signing"]
        environ = {e["name"]: e.get("value", "") for e in env if "value" in e}
        for ref in refs:  # as the kubelet resolves it
            key = ref["valueFrom"]["secretKeyRef"]["key"]
            environ[ref["name"]] = base64.b64decode(secret["data"][key]).decode()
        environ |= {"REFIT_POD_NAME": "p", "REFIT_POD_UID": "u", "REFIT_NAMESPACE": "ns"}
        configs[role] = WorkerConfig.from_env(environ)
    policy, rollout = configs["policy"], configs["rollout"]
    assert policy.signing_key and not policy.verify_key
    assert rollout.verify_key and not rollout.signing_key
    assert RefitSigner(base64.b64decode(policy.signing_key)).public == base64.b64decode(
        rollout.verify_key
    )
    assert policy.signing_key not in repr(policy)


def test_prestop_injection_mounts_the_pid_dir() -> None:
    spec = _spec(preemption={"signal": "usr2", "injection": "preStop", "gracePeriodSeconds": 40})
    pod = render_pod(JOB, spec, "policy", 0, epoch=0, options=RenderOptions())
    container = pod["spec"]["containers"][0]
    assert container["lifecycle"] == {
        "preStop": {"exec": {"command": ["refit-signal", "--timeout", "30"]}}
    }
    assert "os" not in pod["spec"]
    assert pod["spec"]["volumes"] == [
        {"name": "tmp", "emptyDir": {}},
        {"name": "refit-signal", "emptyDir": {}},
    ]
    assert container["volumeMounts"] == [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "refit-signal", "mountPath": "/var/run/refit"},
    ]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["REFIT_SIGNAL_PID_DIR"] == "/var/run/refit"
    assert env["REFIT_PREEMPTION_SIGNAL"] == "SIGUSR2"  # canonical, whatever the spelling


def test_auto_injection_follows_the_cluster() -> None:
    spec = _spec(preemption={"signal": "SIGTERM", "injection": "auto"})
    new = render_pod(
        JOB, spec, "policy", 0, epoch=0, options=RenderOptions(stop_signal_supported=True)
    )
    old = render_pod(JOB, spec, "policy", 0, epoch=0, options=RenderOptions())
    assert new["spec"]["containers"][0]["lifecycle"] == {"stopSignal": "SIGTERM"}
    assert "preStop" in old["spec"]["containers"][0]["lifecycle"]


def test_role_overrides_and_safetensors_volume() -> None:
    spec = _spec(
        policy={
            "replicas": 1,
            "command": ["python", "-m", "trainer"],
            "args": ["--x"],
            "resources": {"limits": {"nvidia.com/gpu": "1"}},
            "template": {
                "spec": {
                    "nodeSelector": {"gpu": "h100"},
                    "tolerations": [{"key": "gpu", "operator": "Exists"}],
                    "serviceAccountName": "mine",
                    "containers": [{"name": "worker"}],
                }
            },
        },
        weights={"safetensors": {"claimName": "ckpt", "path": "step-100"}},
    )
    pod = render_pod(JOB, spec, "policy", 0, epoch=0, options=RenderOptions())
    c = pod["spec"]["containers"][0]
    assert (c["command"], c["args"]) == (["python", "-m", "trainer"], ["--x"])
    assert c["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert pod["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert pod["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert pod["spec"]["serviceAccountName"] == "mine"
    assert {"name": "weights", "mountPath": "/var/lib/refit/weights", "readOnly": True} in c[
        "volumeMounts"
    ]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert '"path":"/var/lib/refit/weights/step-100"' in env["REFIT_WEIGHTS"]


def test_service_golden() -> None:
    assert render_service(JOB, "policy") == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "job-policy",
            "namespace": "ns",
            "labels": {**LABELS, "refit.dev/role": "policy"},
            "ownerReferences": OWNER,
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"refit.dev/job": "job", "refit.dev/role": "policy"},
            "ports": [{"name": "dist", "port": 29500, "targetPort": 29500}],
        },
    }


def test_rendezvous_shards_by_rank_count() -> None:
    small = render_rendezvous(JOB, _spec())
    # The operator's map, then each role's: no map holds both roles' entries.
    names = ["job-rendezvous", "job-rendezvous-policy", "job-rendezvous-rollout"]
    assert [m["metadata"]["name"] for m in small] == names
    assert small[0]["data"] == {} and small[0]["metadata"]["ownerReferences"] == OWNER
    big = render_rendezvous(JOB, _spec(policy={"replicas": 100}, rollout={"replicas": 101}))
    assert [m["metadata"]["name"] for m in big] == [*names, "job-rendezvous-rollout-1"]


def test_rbac_limits_the_worker_to_its_rendezvous() -> None:
    # 150 policy ranks: two policy maps of at most RANKS_PER_SHARD (100) each.
    objs = render_rbac(JOB, _spec(policy={"replicas": 150}))
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        (kind, f"job-{role}-worker")
        for role in ("policy", "rollout")
        for kind in ("ServiceAccount", "Role", "RoleBinding")
    ]
    every = ["job-rendezvous", "job-rendezvous-policy", "job-rendezvous-policy-1"]
    every.append("job-rendezvous-rollout")
    policy_role, rollout_role = objs[1], objs[4]
    assert policy_role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": every,
            "verbs": ["get", "watch"],
        },
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["job-rendezvous-policy", "job-rendezvous-policy-1"],
            "verbs": ["patch"],
        },
    ]
    assert rollout_role["rules"][1]["resourceNames"] == ["job-rendezvous-rollout"]
    assert objs[5]["subjects"] == [
        {"kind": "ServiceAccount", "name": "job-rollout-worker", "namespace": "ns"}
    ]
    assert render_rbac(JOB, _spec(createServiceAccount=False)) == []


def test_every_child_is_owned_and_labelled() -> None:
    children = render_static(JOB, _spec()) + render_gang(JOB, _spec(), 0, RenderOptions())
    # Per role its RBAC (3), the Services (2), the maps (3), the pods (3); a Secret aside.
    assert len([c for c in children if c["kind"] != "Secret"]) == 6 + 2 + 3 + 3
    for child in children:
        assert child["metadata"]["ownerReferences"] == OWNER
        assert child["metadata"]["labels"]["refit.dev/job"] == "job"
    assert sorted(c["metadata"]["name"] for c in children if c["kind"] == "Pod") == [
        "job-policy-0-e0",
        "job-policy-1-e0",
        "job-rollout-0-g0",
    ]


def test_a_recreated_gang_resumes_after_the_refits_done() -> None:
    pods = render_gang(JOB, _spec(), 2, RenderOptions(), first_refit=5)
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert (env["REFIT_FIRST_REFIT"], env["REFIT_EPOCH"]) == ("5", "2")


def test_spec_hash_follows_what_shapes_the_pods() -> None:
    base = spec_hash(_spec())
    assert spec_hash(_spec()) == base
    assert spec_hash(_spec(failurePolicy={"maxRestarts": 9}, suspend=True)) == base
    rollout = {"replicas": 1, "env": [{"name": "X", "value": "1"}]}
    # Scaling the rollout replicas (kubectl scale, an HPA) and their failure policy are
    # no spec change; the policy's replica count and the rollout pods' shape are.
    scaled = {**rollout, "replicas": 5, "failurePolicy": {"maxReplacements": 2}}
    assert spec_hash(_spec(rollout=scaled)) == base
    assert spec_hash(_spec(policy={"replicas": 3})) != base
    assert spec_hash(_spec(rollout={**rollout, "env": []})) != base
    assert spec_hash(_spec(image="img:2")) != base
    assert spec_hash(_spec(metrics={"port": 9400})) != base


def test_only_a_rollout_pod_hands_over_on_a_drain() -> None:
    def hand_over(role: str) -> str:
        pod = render_pod(JOB, _spec(), role, 0, epoch=0, options=RenderOptions())  # type: ignore[arg-type]
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        return str(env["REFIT_HAND_OVER_SECONDS"])

    # A policy pod's stop ends its gang's epoch: no one seeds from it.
    assert (hand_over("policy"), hand_over("rollout")) == ("0.0", "20.0")
