"""Rendered worker pods meet the "restricted" Pod Security Standard, and the per-job Role
lets a worker touch only its own job's rendezvous ConfigMaps (pure).

Real: the operator's renderers over a matrix of specs (every injection mode, both roles,
synthetic and safetensors weights, one and two rendezvous shards) and the worker's
ConfigMap store source, read as an AST to list the API calls it makes.  Nothing emulated.
Each checker is also shown a manifest it must refuse, so a check that passes everything
would fail here.
"""

from __future__ import annotations

import ast
import copy
import itertools
from pathlib import Path
from typing import Any

import pytest

from refit_operator.api.models import parse_spec
from refit_operator.api.names import (
    rendezvous_maps,
    rendezvous_name,
    role_rendezvous_maps,
    worker_account_name,
)
from refit_operator.render.children import render_rbac
from refit_operator.render.pods import JobRef, RenderOptions, render_gang

ROOT = Path(__file__).resolve().parents[2]
STORE_SOURCE = ROOT / "worker" / "refit_worker" / "rendezvous" / "configmap_store.py"
JOB = JobRef(name="job", namespace="ns", uid="u-1")
#: Volume types the restricted profile allows.
ALLOWED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def pod_security_problems(pod: dict[str, Any]) -> list[str]:
    """What keeps ``pod`` from the restricted profile (empty: nothing)."""
    spec = pod["spec"]
    pod_ctx = spec.get("securityContext") or {}
    problems = [f"spec.{k} is set" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            problems.append(f"volume {volume['name']} is of type {sorted(kinds)}")
    if pod_ctx.get("runAsUser") == 0:
        problems.append("pod runs as uid 0")
    containers = [
        (kind, c)
        for kind in ("initContainers", "containers", "ephemeralContainers")
        for c in spec.get(kind, [])
    ]
    for kind, container in containers:
        where = f"{kind}[{container['name']}]"
        ctx = container.get("securityContext") or {}
        non_root = ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot"))
        if non_root is not True:
            problems.append(f"{where}: runAsNonRoot is {non_root!r}")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            problems.append(f"{where}: runs as uid 0")
        if ctx.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation is not false")
        if ctx.get("privileged"):
            problems.append(f"{where}: privileged")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            problems.append(f"{where}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{where}: adds capabilities {caps['add']}")
        seccomp = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{where}: seccompProfile is {seccomp!r}")
        if any("hostPort" in p for p in container.get("ports", [])):
            problems.append(f"{where}: uses a hostPort")
    return problems


def _spec(injection: str, weights: dict[str, Any], replicas: int) -> Any:
    return parse_spec(
        {
            "image": "img:1",
            "policy": {"replicas": replicas},
            "rollout": {"replicas": 2},
            "weights": weights,
            "preemption": {"signal": "SIGUSR1", "injection": injection},
        }
    )


WEIGHTS = ({"synthetic": {"layers": 1}}, {"safetensors": {"claimName": "ckpt", "path": "m"}})
MATRIX = list(itertools.product(("auto", "stopSignal", "preStop"), (False, True), WEIGHTS))


@pytest.mark.parametrize(("injection", "stop_signal_supported", "weights"), MATRIX)
def test_every_rendered_pod_is_restricted(
    injection: str, stop_signal_supported: bool, weights: dict[str, Any]
) -> None:
    spec = _spec(injection, weights, replicas=2)
    pods = render_gang(JOB, spec, 0, RenderOptions(stop_signal_supported=stop_signal_supported))
    assert len(pods) == 4
    for pod in pods:
        assert pod_security_problems(pod) == [], pod["metadata"]["name"]
        role = pod["metadata"]["labels"]["refit.dev/role"]
        assert pod["spec"]["serviceAccountName"] == worker_account_name(JOB.name, role)
        assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda p: p["spec"].__setitem__("hostNetwork", True), "spec.hostNetwork is set"),
        (lambda p: p["spec"]["securityContext"].__setitem__("runAsUser", 0), "uid 0"),
        (
            lambda p: [
                p["spec"]["securityContext"].pop("runAsNonRoot"),
                p["spec"]["containers"][0]["securityContext"].pop("runAsNonRoot"),
            ],
            "runAsNonRoot is None",
        ),
        (
            lambda p: p["spec"]["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
            "allowPrivilegeEscalation is not false",
        ),
        (
            lambda p: p["spec"]["containers"][0]["securityContext"].__setitem__("privileged", True),
            "privileged",
        ),
        (
            lambda p: p["spec"]["containers"][0]["securityContext"]["capabilities"].__setitem__(
                "drop", ["NET_RAW"]
            ),
            "capabilities do not drop ALL",
        ),
        (
            lambda p: p["spec"]["containers"][0]["securityContext"]["capabilities"].__setitem__(
                "add", ["SYS_PTRACE"]
            ),
            "adds capabilities ['SYS_PTRACE']",
        ),
        (lambda p: p["spec"]["securityContext"].pop("seccompProfile"), "seccompProfile is None"),
        (
            lambda p: (
                p["spec"]
                .setdefault("volumes", [])
                .append({"name": "root", "hostPath": {"path": "/"}})
            ),
            "volume root is of type ['hostPath']",
        ),
        (
            lambda p: p["spec"]["containers"][0]["ports"][0].__setitem__("hostPort", 80),
            "uses a hostPort",
        ),
        (
            lambda p: p["spec"].__setitem__("initContainers", [{"name": "init"}]),
            "initContainers[init]: allowPrivilegeEscalation is not false",
        ),
    ],
)
def test_the_checker_refuses_an_unsafe_pod(change: Any, problem: str) -> None:
    (pod, *_) = render_gang(JOB, _spec("preStop", WEIGHTS[0], 1), 0, RenderOptions())
    unsafe = copy.deepcopy(pod)
    change(unsafe)
    assert any(problem in p for p in pod_security_problems(unsafe)), pod_security_problems(unsafe)


def _by_role(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["labels"]["refit.dev/role"]: o for o in objs if o["kind"] == kind}


@pytest.mark.parametrize("policy_replicas", [1, 200])
def test_each_role_reads_the_jobs_maps_and_patches_only_its_own(policy_replicas: int) -> None:
    spec = _spec("auto", WEIGHTS[0], policy_replicas)
    objs = render_rbac(JOB, spec)
    accounts, roles = _by_role(objs, "ServiceAccount"), _by_role(objs, "Role")
    bindings = _by_role(objs, "RoleBinding")
    every = rendezvous_maps(JOB.name, policy_replicas, 2)
    for name in ("policy", "rollout"):
        role = roles[name]
        read, patch = role["rules"]
        assert read == {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": every,
            "verbs": ["get", "watch"],
        }
        own = role_rendezvous_maps(JOB.name, name, policy_replicas, 2)  # type: ignore[arg-type]
        assert patch["resourceNames"] == own and patch["verbs"] == ["patch"]
        # Never the operator's map (the barrier, the notice), never the other role's.
        assert rendezvous_name(JOB.name) not in own
        assert not set(own) & set(
            role_rendezvous_maps(
                JOB.name, "rollout" if name == "policy" else "policy", policy_replicas, 2
            )
        )
        assert "*" not in str(role["rules"]) and role["kind"] == "Role"
        assert bindings[name]["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert bindings[name]["subjects"] == [
            {
                "kind": "ServiceAccount",
                "name": accounts[name]["metadata"]["name"],
                "namespace": "ns",
            }
        ]
    assert accounts["policy"]["metadata"]["name"] != accounts["rollout"]["metadata"]["name"]
    # A job whose name extends this one's gets none of its maps (names, not prefixes).
    other = render_rbac(JobRef(name="job-rendezvous", namespace="ns", uid="u-2"), spec)
    theirs = {n for r in _by_role(other, "Role").values() for n in r["rules"][0]["resourceNames"]}
    assert not set(every) & theirs


#: kubernetes client method → the RBAC verb of the request it makes.
_VERB_OF = {
    "read_namespaced_config_map": "get",
    "patch_namespaced_config_map": "patch",
    "list_namespaced_config_map": "list",
    "replace_namespaced_config_map": "update",
    "create_namespaced_config_map": "create",
    "delete_namespaced_config_map": "delete",
}


def api_verbs(source: str) -> list[tuple[str, str]]:
    """(method, RBAC verb) of every ConfigMap API call in ``source``; a list with
    ``watch=True`` is a watch, and must select one object by name for resourceNames."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        method = node.func.attr
        if "config_map" not in method:
            continue
        verb = _VERB_OF.get(method, f"unknown:{method}")
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        watch = keywords.get("watch")
        if verb == "list" and isinstance(watch, ast.Constant) and watch.value is True:
            selector = keywords.get("field_selector")
            by_name = isinstance(selector, ast.JoinedStr) and ast.unparse(selector).startswith(
                "f'metadata.name="
            )
            verb = "watch" if by_name else "watch (not by name)"
        found.append((method, verb))
    return found


def test_the_workers_api_calls_fit_the_role() -> None:
    calls = api_verbs(STORE_SOURCE.read_text())
    assert {m for m, _ in calls} >= {"read_namespaced_config_map", "patch_namespaced_config_map"}
    role = _by_role(render_rbac(JOB, _spec("auto", WEIGHTS[0], 1)), "Role")["rollout"]
    granted = {verb for rule in role["rules"] for verb in rule["verbs"]}
    assert {verb for _, verb in calls} <= granted, calls


def test_the_call_checker_sees_a_call_the_role_refuses() -> None:
    source = (
        "def f(api, name, ns):\n"
        "    api.list_namespaced_config_map(ns, watch=True)\n"
        "    api.list_namespaced_config_map(\n"
        "        ns, field_selector=f'metadata.name={name}', watch=True)\n"
        "    api.delete_namespaced_config_map(name, ns)\n"
        "    api.list_config_map_for_all_namespaces()\n"
    )
    assert api_verbs(source) == [
        ("list_namespaced_config_map", "watch (not by name)"),
        ("list_namespaced_config_map", "watch"),
        ("delete_namespaced_config_map", "delete"),
        ("list_config_map_for_all_namespaces", "unknown:list_config_map_for_all_namespaces"),
    ]
