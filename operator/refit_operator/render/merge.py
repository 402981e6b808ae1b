"""A role's pod template with the operator's parts merged in, or the fields that conflict.

The operator owns a pod's identity (name, the ``refit.dev/*`` labels and annotations, the
ownerReference), how it stops and restarts (``restartPolicy: Never``, the grace period,
the preemption ``lifecycle``, the termination message), its rendezvous DNS name
(``hostname``, ``subdomain``), the gang's scheduling gate, and the worker container's
``REFIT_*`` env, port and volumes.  A template that sets any of these differently is
refused, every such field named with its path; everything else in the template reaches
the pods as written.  Security settings are defaults, not owned: the template's values
win key by key (``capabilities.add: [IPC_LOCK]`` keeps the default ``drop: [ALL]``).

Pure: ``pods.py`` turns the spec into :class:`PodParts` for it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: The container that runs the rank; other containers of a template are sidecars.
WORKER = "worker"
#: Label and annotation prefixes the operator owns.
OWNED_PREFIXES = ("refit.dev/",)
OWNED_LABELS = frozenset({"app.kubernetes.io/managed-by"})


class TemplateConflict(ValueError):
    """The template sets what the operator owns; the message names every such field."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class WorkerParts:
    """The worker container as the operator renders it."""

    image: str
    image_pull_policy: str
    #: The command when neither the short form nor the template gives one.
    default_command: list[str]
    #: From the short form (``policy.command`` ...): empty when unset.
    command: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    #: The operator's env (``REFIT_*``), then the short form's.
    env: list[dict[str, Any]] = field(default_factory=list)
    extra_env: list[dict[str, Any]] = field(default_factory=list)
    resources: dict[str, Any] = field(default_factory=dict)
    ports: list[dict[str, Any]] = field(default_factory=list)
    lifecycle: dict[str, Any] = field(default_factory=dict)
    termination_message_path: str = "/dev/termination-log"
    termination_message_policy: str = "FallbackToLogsOnError"
    volume_mounts: list[dict[str, Any]] = field(default_factory=list)
    security_context: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PodParts:
    """Everything the operator puts into one pod."""

    metadata: dict[str, Any]
    worker: WorkerParts
    hostname: str
    subdomain: str
    grace_seconds: int
    #: The per-job account, used when the template names none ('' : none).
    service_account: str = ""
    #: ``spec.os`` the pod needs (``lifecycle.stopSignal`` requires one), or None.
    os_name: str | None = None
    scheduling_gates: list[str] = field(default_factory=list)
    #: ``schedulerName`` when the template names none (a gang scheduler), or ''.
    scheduler_name: str = ""
    volumes: list[dict[str, Any]] = field(default_factory=list)
    security_context: dict[str, Any] = field(default_factory=dict)


def merge_pod(template: Mapping[str, Any] | None, parts: PodParts, where: str) -> dict[str, Any]:
    """The pod: ``template`` (a PodTemplateSpec, or None) with ``parts`` merged in.

    Raises :class:`TemplateConflict` naming every field (``where`` is the template's path,
    e.g. ``spec.policy.template``) that the template sets against the operator.
    """
    source = copy.deepcopy(dict(template or {}))
    problems: list[str] = []
    meta = _metadata(source.get("metadata") or {}, parts.metadata, f"{where}.metadata", problems)
    spec = _pod_spec(source.get("spec") or {}, parts, f"{where}.spec", problems)
    if problems:
        raise TemplateConflict(problems)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _owned_key(key: str) -> bool:
    return key in OWNED_LABELS or key.startswith(OWNED_PREFIXES)


def _metadata(
    meta: Mapping[str, Any], ours: Mapping[str, Any], where: str, problems: list[str]
) -> dict[str, Any]:
    out = dict(ours)
    for kind in ("labels", "annotations"):
        theirs = dict(meta.get(kind) or {})
        owned = dict(ours.get(kind) or {})
        for key in sorted(theirs):
            if _owned_key(key) or (key in owned and theirs[key] != owned[key]):
                problems.append(
                    f"{where}.{kind}[{key}]: the operator sets this {kind[:-1]} on every pod;"
                    " remove it"
                )
        merged = {**theirs, **owned}
        if merged:
            out[kind] = merged
    return out


def _conflict(problems: list[str], path: str, value: Any, why: str) -> None:
    problems.append(f"{path}: {value!r} conflicts with the operator: {why}")


def _pod_spec(
    spec: dict[str, Any], parts: PodParts, where: str, problems: list[str]
) -> dict[str, Any]:
    fixed = {
        "restartPolicy": (
            "Never",
            "a failed rank restarts the whole gang; leave it unset or Never",
        ),
        "hostname": (parts.hostname, "it is the rank's rendezvous DNS name"),
        "subdomain": (parts.subdomain, "it is the role's headless Service"),
        "terminationGracePeriodSeconds": (
            parts.grace_seconds,
            "set spec.preemption.gracePeriodSeconds instead",
        ),
    }
    for key, (value, why) in fixed.items():
        if key in spec and spec[key] != value:
            _conflict(problems, f"{where}.{key}", spec[key], why)
        spec[key] = value
    if "nodeName" in spec:
        _conflict(
            problems, f"{where}.nodeName", spec["nodeName"], "it bypasses the gang's admission"
        )
    if "serviceAccount" in spec:
        _conflict(
            problems,
            f"{where}.serviceAccount",
            spec["serviceAccount"],
            "the field is deprecated; use serviceAccountName",
        )
    if not spec.get("serviceAccountName") and parts.service_account:
        spec["serviceAccountName"] = parts.service_account
    _scheduling(spec, parts, where, problems)
    spec["volumes"] = _named_union(
        spec.get("volumes") or [], parts.volumes, f"{where}.volumes", problems
    )
    if not spec["volumes"]:
        del spec["volumes"]
    spec["securityContext"] = {**parts.security_context, **(spec.get("securityContext") or {})}
    containers = list(spec.get("containers") or [])
    index = next((i for i, c in enumerate(containers) if c.get("name") == WORKER), None)
    if containers and index is None:
        names = ", ".join(repr(c.get("name")) for c in containers)
        problems.append(
            f"{where}.containers: no container is named {WORKER!r} (got {names}); the rank runs"
            f" in the container named {WORKER!r}, any other is a sidecar"
        )
        return spec
    theirs = containers.pop(index) if index is not None else {"name": WORKER}
    path = f"{where}.containers[{index if index is not None else 0}]"
    # The worker first: one-container runtimes (the process kubelet) run the first.
    spec["containers"] = [_worker(theirs, parts.worker, path, problems), *containers]
    return spec


def _scheduling(spec: dict[str, Any], parts: PodParts, where: str, problems: list[str]) -> None:
    """The node OS the stop signal needs, the gang's scheduling gates, the scheduler."""
    if parts.os_name is not None:
        os_name = (spec.get("os") or {}).get("name", parts.os_name)
        if os_name != parts.os_name:
            _conflict(problems, f"{where}.os.name", os_name, "the stop signal needs linux")
        spec["os"] = {**(spec.get("os") or {}), "name": parts.os_name}
    gates = list(spec.get("schedulingGates") or [])
    for gate in parts.scheduling_gates:
        if any(g.get("name") == gate for g in gates):
            _conflict(problems, f"{where}.schedulingGates", gate, "the operator lifts this gate")
    if gates or parts.scheduling_gates:
        spec["schedulingGates"] = gates + [{"name": g} for g in parts.scheduling_gates]
    if parts.scheduler_name and not spec.get("schedulerName"):
        spec["schedulerName"] = parts.scheduler_name


def _named_union(
    theirs: list[dict[str, Any]], ours: list[dict[str, Any]], where: str, problems: list[str]
) -> list[dict[str, Any]]:
    taken = {o["name"] for o in ours}
    for i, item in enumerate(theirs):
        if item.get("name") in taken:
            problems.append(f"{where}[{i}].name: {item['name']!r} is the operator's; rename it")
    return [*theirs, *ours]


def _worker(
    theirs: dict[str, Any], ours: WorkerParts, where: str, problems: list[str]
) -> dict[str, Any]:
    out = dict(theirs)
    out.setdefault("image", ours.image)
    out.setdefault("imagePullPolicy", ours.image_pull_policy)
    for key, short in (("command", ours.command), ("args", ours.args)):
        if key in theirs and short:
            _conflict(problems, f"{where}.{key}", theirs[key], f"the role's short form sets {key}")
    out["command"] = theirs.get("command") or ours.command or ours.default_command
    args = theirs.get("args") or ours.args
    if args:
        out["args"] = args
    if theirs.get("resources") and any(ours.resources.values()):
        _conflict(
            problems,
            f"{where}.resources",
            theirs["resources"],
            "the role's short form sets resources; set them in one place",
        )
    resources = theirs.get("resources") or {k: v for k, v in ours.resources.items() if v}
    if resources:
        out["resources"] = resources
    out["env"] = _env(theirs.get("env") or [], ours, f"{where}.env", problems)
    for key, value in (
        ("terminationMessagePath", ours.termination_message_path),
        ("terminationMessagePolicy", ours.termination_message_policy),
    ):
        if key in theirs and theirs[key] != value:
            _conflict(problems, f"{where}.{key}", theirs[key], "the operator reads why ranks fail")
        out[key] = value
    lifecycle = dict(theirs.get("lifecycle") or {})
    for key in ("preStop", "stopSignal"):
        if key in lifecycle:
            _conflict(
                problems,
                f"{where}.lifecycle.{key}",
                lifecycle[key],
                "the operator delivers the preemption signal (spec.preemption)",
            )
    out["lifecycle"] = {**lifecycle, **ours.lifecycle}
    out["ports"] = _ports(theirs.get("ports") or [], ours.ports, f"{where}.ports", problems)
    mounts = list(theirs.get("volumeMounts") or [])
    paths = {m["mountPath"] for m in ours.volume_mounts}
    for i, mount in enumerate(mounts):
        if mount.get("mountPath") in paths:
            problems.append(
                f"{where}.volumeMounts[{i}].mountPath: {mount['mountPath']!r} is the operator's"
            )
    out["volumeMounts"] = _named_union(
        mounts, ours.volume_mounts, f"{where}.volumeMounts", problems
    )
    if not out["volumeMounts"]:
        del out["volumeMounts"]
    out["securityContext"] = _security(ours.security_context, theirs.get("securityContext") or {})
    return out


def _env(
    theirs: list[dict[str, Any]], ours: WorkerParts, where: str, problems: list[str]
) -> list[dict[str, Any]]:
    short = {e["name"] for e in ours.extra_env}
    for i, item in enumerate(theirs):
        name = str(item.get("name", ""))
        if name.startswith("REFIT_"):
            problems.append(f"{where}[{i}].name: {name!r} is reserved for the worker config")
        elif name in short:
            problems.append(f"{where}[{i}].name: {name!r} is also set by the role's short form env")
    # The operator's first, so the template's may refer to them as $(REFIT_RANK).
    return [*ours.env, *ours.extra_env, *theirs]


def _ports(
    theirs: list[dict[str, Any]], ours: list[dict[str, Any]], where: str, problems: list[str]
) -> list[dict[str, Any]]:
    for i, port in enumerate(theirs):
        for mine in ours:
            if (
                port.get("name") == mine["name"]
                or port.get("containerPort") == mine["containerPort"]
            ):
                what = "rendezvous" if mine["name"] == "dist" else "metrics"
                problems.append(
                    f"{where}[{i}]: port {port.get('name') or port.get('containerPort')!r} is the"
                    f" ranks' {what} port ({mine['name']}, {mine['containerPort']})"
                )
    return [*ours, *theirs]


def _security(defaults: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, Any]:
    out = {**defaults, **theirs}
    caps = {**(defaults.get("capabilities") or {}), **(theirs.get("capabilities") or {})}
    if caps:
        out["capabilities"] = caps
    if theirs.get("privileged") and "allowPrivilegeEscalation" not in theirs:
        # The API refuses privileged together with allowPrivilegeEscalation: false.
        out.pop("allowPrivilegeEscalation", None)
    return out
