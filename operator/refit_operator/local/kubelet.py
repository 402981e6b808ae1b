"""A process kubelet: runs rendered pod manifests as local processes.

One piece of code plays kubelet for ``refit run`` (no cluster) and for the process nodes
of the cluster test tier (``tests/cluster/node.py``, a real apiserver): it starts a pod's
first container ``command + args`` with the container's env, reports the pod's status in
Kubernetes form (phase, Ready condition, ``containerStatuses[].state.terminated.exitCode``),
and terminates pods the way a kubelet does — the ``preStop`` exec hook first, then the
container's stop signal (``lifecycle.stopSignal`` or SIGTERM), then SIGKILL once the grace
period is spent.

What a node would provide is emulated minimally and said so: ``emptyDir`` volumes are
per-pod temporary directories (env values under a mount path are rewritten to point
there), the downward API fills ``metadata.name/namespace/uid``, ``spec.nodeName``,
``spec.serviceAccountName`` and the (loopback) pod and host IPs, a caller-supplied
``env_source`` hook reads other ``valueFrom`` sources (Secrets, ConfigMaps), and a
``rewrite_env`` hook plays cluster networking (one host, so Service names and ports are
mapped to loopback and free ports).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from refit_worker.contract.signals import signal_from_name

#: Optional hook: (pod manifest, resolved env) -> env the process really gets.
EnvRewrite = Callable[[Mapping[str, Any], dict[str, str]], dict[str, str]]
#: Optional hook: (pod manifest, an env entry's ``valueFrom``) -> its value, for sources
#: other than the downward API (``secretKeyRef``, ``configMapKeyRef``: a node reads them
#: from the API); raises KubeletError when the value cannot be had.
EnvSource = Callable[[Mapping[str, Any], Mapping[str, Any]], str]


class KubeletError(RuntimeError):
    """A pod manifest cannot be run as a local process."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _stop_signal(name: str | None) -> signal.Signals:
    """The container's ``lifecycle.stopSignal`` (SIGTERM when unset), by the one parser."""
    if not name:
        return signal.SIGTERM
    try:
        return signal_from_name(name)
    except ValueError as exc:
        raise KubeletError(f"unknown stop signal {name!r}") from exc


@dataclass
class _Pod:
    manifest: dict[str, Any]
    root: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes]
    log_path: Path
    started: str = field(default_factory=_now)
    exit_code: int | None = None
    finished: str | None = None
    stopping: threading.Thread | None = None
    conditions: list[dict[str, Any]] = field(default_factory=list)
    #: The container's termination message, read when it exited (as a kubelet does).
    message: str = ""

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


class ProcessKubelet:
    """Runs pods as process groups under ``workdir``; thread-safe."""

    def __init__(
        self,
        workdir: Path,
        *,
        rewrite_env: EnvRewrite | None = None,
        base_env: Mapping[str, str] | None = None,
        die_with_parent: bool = False,
        claims: Mapping[str, Path] | None = None,
        env_source: EnvSource | None = None,
    ) -> None:
        # Absolute: each pod's process runs with its own directory as cwd.
        self.workdir = Path(workdir).resolve()
        self._die_with_parent = die_with_parent
        #: PersistentVolumeClaim name -> the local directory that serves it.
        self._claims = dict(claims or {})
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._rewrite = rewrite_env
        self._env_source = env_source
        # The project's console scripts (refit-worker, refit-signal) live beside this Python.
        env = dict(os.environ if base_env is None else base_env)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        self._base_env = env
        self._pods: dict[str, _Pod] = {}
        #: (pod name, uid) -> exit code of every process that ended, deleted pods included.
        self.exit_codes: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------

    def serve_claim(self, claim: str, directory: Path) -> None:
        """Serve PersistentVolumeClaim ``claim`` from ``directory`` to pods started from now
        on, as a node with that volume attached would."""
        self._claims[claim] = Path(directory).resolve()

    def claim_dir(self, claim: str) -> Path | None:
        """The local directory that serves PersistentVolumeClaim ``claim``, if any."""
        return self._claims.get(claim)

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Start the pod's process; returns the manifest as stored (uid filled in)."""
        pod = _with_uid(manifest)
        name = str(pod["metadata"]["name"])
        with self._lock:
            if name in self._pods:
                raise KubeletError(f"pod {name} already exists")
            root = self.workdir / "pods" / f"{name}-{pod['metadata']['uid'][:8]}"
            env = self._container_env(pod, root)
            argv = _argv(pod)
            log_path = self.workdir / "logs" / f"{name}-{pod['metadata']['uid'][:8]}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with log_path.open("wb") as log:
                try:
                    process = subprocess.Popen(
                        argv,
                        env={**self._base_env, **env},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        cwd=root,
                        # Only a prctl and a getppid run in the child: no locks, no imports.
                        preexec_fn=(  # noqa: PLW1509
                            _parent_death_kill() if self._die_with_parent else None
                        ),
                    )
                except OSError as exc:
                    shutil.rmtree(root, ignore_errors=True)
                    raise KubeletError(f"pod {name}: cannot start {argv[0]!r}: {exc}") from exc
            self._pods[name] = _Pod(pod, root, env, process, log_path)
            return pod

    def delete(self, name: str, *, grace_seconds: float | None = None) -> bool:
        """Begin terminating ``name`` (preStop, stop signal, SIGKILL after grace).

        Returns False when there is no such pod.  Does not wait; :meth:`pods` shows the
        pod with a ``deletionTimestamp`` until its process group is gone.
        """
        with self._lock:
            pod = self._pods.get(name)
            if pod is None:
                return False
            meta = pod.manifest["metadata"]
            if pod.stopping is not None:
                return True
            meta["deletionTimestamp"] = _now()
            grace = grace_seconds
            if grace is None:
                grace = float(pod.manifest["spec"].get("terminationGracePeriodSeconds", 30))
            pod.stopping = threading.Thread(
                target=self._terminate, args=(pod, grace), name=f"stop-{name}", daemon=True
            )
            pod.stopping.start()
            return True

    def disrupt(self, name: str, reason: str = "EvictionByEvictionAPI") -> bool:
        """What a drain does: mark ``DisruptionTarget`` on the pod, then delete it."""
        with self._lock:
            pod = self._pods.get(name)
            if pod is None:
                return False
            pod.conditions.append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": reason,
                    "message": "the node is being drained",
                    "lastTransitionTime": _now(),
                }
            )
        return self.delete(name)

    def set_scheduling_gates(self, name: str, gates: tuple[str, ...]) -> bool:
        """Keep only ``gates`` in the pod's ``spec.schedulingGates`` (False: no such pod).
        The process starts at creation either way: one machine has nothing to schedule."""
        with self._lock:
            pod = self._pods.get(name)
            if pod is None:
                return False
            spec = pod.manifest["spec"]
            if gates:
                spec["schedulingGates"] = [{"name": g} for g in gates]
            else:
                spec.pop("schedulingGates", None)
            return True

    def close(self, timeout: float = 30.0) -> None:
        """Terminate every pod and wait (bounded) until all process groups are gone."""
        with self._lock:
            names = list(self._pods)
        for name in names:
            self.delete(name)
        deadline = time.monotonic() + timeout
        for name in names:
            pod = self._pods.get(name)
            if pod is not None and pod.stopping is not None:
                pod.stopping.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            for pod in self._pods.values():
                _kill_group(pod.process)
                pod.process.wait(5)
                # Every process that ended is in exit_codes, those stopped here included:
                # a pod drained just as its job finished still shows how it went.
                self._reap(pod)
                shutil.rmtree(pod.root, ignore_errors=True)
            self._pods.clear()

    # -- observation -----------------------------------------------------------------

    def pods(self) -> list[dict[str, Any]]:
        """Every pod's manifest with a current ``status``; fully terminated deleted pods go."""
        out: list[dict[str, Any]] = []
        with self._lock:
            for name in list(self._pods):
                pod = self._pods[name]
                self._reap(pod)
                deleting = "deletionTimestamp" in pod.manifest["metadata"]
                gone = pod.exit_code is not None and (
                    pod.stopping is None or not pod.stopping.is_alive()
                )
                if deleting and gone:
                    shutil.rmtree(pod.root, ignore_errors=True)
                    del self._pods[name]
                    continue
                out.append({**pod.manifest, "status": self._status(pod)})
        return out

    def log_tail(self, name: str, lines: int = 20) -> str:
        """The last ``lines`` lines of a live or finished pod's log ('' if unknown)."""
        with self._lock:
            pod = self._pods.get(name)
        if pod is None or not pod.log_path.exists():
            return ""
        text = pod.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def pids(self) -> dict[str, int]:
        """Pod name -> pid of its main process (for tests and diagnostics)."""
        with self._lock:
            return {name: pod.process.pid for name, pod in self._pods.items()}

    # -- internals -------------------------------------------------------------------

    def _container_env(self, pod: Mapping[str, Any], root: Path) -> dict[str, str]:
        container = pod["spec"]["containers"][0]
        mounts = _volume_mounts(pod, root, self._claims)
        # As a node bind-mounts a file there: the container's termination message file.
        mounts[_termination_path(container)] = root / TERMINATION_FILE
        env: dict[str, str] = {}
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = _remap(str(item["value"]), mounts)
            elif "valueFrom" in item:
                source = item["valueFrom"]
                if "fieldRef" in source:
                    env[item["name"]] = _field_ref(pod, source)
                elif self._env_source is not None:
                    env[item["name"]] = self._env_source(pod, source)
                else:
                    raise KubeletError(
                        f"pod {pod['metadata']['name']}: env {item['name']}: valueFrom "
                        f"{', '.join(sorted(source)) or '(empty)'} is not available on this "
                        "node; only fieldRef (the downward API) is"
                    )
        return self._rewrite(pod, env) if self._rewrite else env

    def _status(self, pod: _Pod) -> dict[str, Any]:
        code = pod.exit_code
        state: dict[str, Any]
        if code is None:
            phase, state = "Running", {"running": {"startedAt": pod.started}}
        else:
            phase = "Succeeded" if code == 0 else "Failed"
            state = {
                "terminated": {
                    "exitCode": code,
                    "finishedAt": pod.finished,
                    "reason": "Completed" if code == 0 else "Error",
                    **({"message": pod.message} if pod.message else {}),
                }
            }
        ready = "True" if code is None else "False"
        conditions = [{"type": "Ready", "status": ready, "lastTransitionTime": pod.started}]
        container = pod.manifest["spec"]["containers"][0]
        return {
            "phase": phase,
            "startTime": pod.started,
            "conditions": conditions + list(pod.conditions),
            "containerStatuses": [
                {
                    "name": container.get("name", "main"),
                    "ready": code is None,
                    "state": state,
                    "restartCount": 0,
                }
            ],
        }

    def _reap(self, pod: _Pod) -> None:
        if pod.exit_code is None:
            code = pod.process.poll()
            if code is not None:
                # Kubernetes reports a signal death as 128 + signal number.
                pod.exit_code = 128 - code if code < 0 else code
                pod.finished = _now()
                pod.message = _termination_message(pod)
                self.exit_codes[(pod.name, pod.manifest["metadata"]["uid"])] = pod.exit_code

    def _terminate(self, pod: _Pod, grace: float) -> None:
        deadline = time.monotonic() + grace
        lifecycle = pod.manifest["spec"]["containers"][0].get("lifecycle") or {}
        hook = ((lifecycle.get("preStop") or {}).get("exec") or {}).get("command")
        if hook and pod.process.poll() is None:
            # The grace period covers the hook too; past it, go on to the signal.
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(
                    list(hook),
                    env={**self._base_env, **pod.env},
                    cwd=pod.root,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=max(0.1, deadline - time.monotonic()),
                    check=False,
                )
        if pod.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.process.pid, _stop_signal(lifecycle.get("stopSignal")))
        try:
            pod.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(pod.process)
            pod.process.wait(10)
        # Children the main process left behind go with its group, as in a container.
        _kill_group(pod.process)


#: The file in a pod's directory that stands for its termination message path.
TERMINATION_FILE = "termination-log"
#: What a kubelet keeps: 4096 bytes of the file; of the log, the last 80 lines or 2048 bytes.
_MESSAGE_BYTES, _LOG_LINES, _LOG_BYTES = 4096, 80, 2048


def _termination_path(container: Mapping[str, Any]) -> str:
    return str(container.get("terminationMessagePath") or "/dev/termination-log").rstrip("/")


def _termination_message(pod: _Pod) -> str:
    """The container's message file or, with FallbackToLogsOnError and a failed exit and no
    message, the end of its log: what a kubelet reports as ``terminated.message``."""
    try:
        text = (pod.root / TERMINATION_FILE).read_bytes()[:_MESSAGE_BYTES]
    except OSError:
        text = b""
    container = pod.manifest["spec"]["containers"][0]
    fallback = container.get("terminationMessagePolicy") == "FallbackToLogsOnError"
    if not text.strip() and fallback and pod.exit_code not in (None, 0):
        try:
            lines = pod.log_path.read_bytes().splitlines()[-_LOG_LINES:]
        except OSError:
            lines = []
        text = b"\n".join(lines)[-_LOG_BYTES:]
    return text.decode("utf-8", errors="replace").strip()


def _with_uid(manifest: Mapping[str, Any]) -> dict[str, Any]:
    import copy

    pod = copy.deepcopy(dict(manifest))
    meta = pod.setdefault("metadata", {})
    if not meta.get("name"):
        raise KubeletError("pod manifest has no metadata.name")
    meta.setdefault("uid", str(uuid.uuid4()))
    meta.setdefault("namespace", "default")
    containers = (pod.get("spec") or {}).get("containers") or []
    if not containers:
        raise KubeletError(f"pod {meta['name']} has no containers")
    return pod


def _argv(pod: Mapping[str, Any]) -> list[str]:
    container = pod["spec"]["containers"][0]
    argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
    if not argv:
        raise KubeletError(
            f"pod {pod['metadata']['name']}: no command (a local run has no image entrypoint)"
        )
    return argv


def _volume_mounts(
    pod: Mapping[str, Any], root: Path, claims: Mapping[str, Path]
) -> dict[str, Path]:
    """Mount path -> local directory: emptyDirs per pod, claims from the node's map."""
    local_dirs: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes") or []:
        if "emptyDir" in volume:
            local_dirs[volume["name"]] = root / "volumes" / volume["name"]
        elif "persistentVolumeClaim" in volume:
            claim = str(volume["persistentVolumeClaim"].get("claimName", ""))
            if claim not in claims:
                raise KubeletError(
                    f"pod {pod['metadata']['name']}: volume {volume['name']!r} needs "
                    f"PersistentVolumeClaim {claim!r}, which this node does not serve"
                )
            local_dirs[volume["name"]] = claims[claim]
    mounts: dict[str, Path] = {}
    for mount in pod["spec"]["containers"][0].get("volumeMounts") or []:
        local = local_dirs.get(mount["name"])
        if local is not None:
            local.mkdir(parents=True, exist_ok=True)
            mounts[str(mount["mountPath"]).rstrip("/")] = local
    root.mkdir(parents=True, exist_ok=True)
    return mounts


def _remap(value: str, mounts: Mapping[str, Path]) -> str:
    if ":" in value:  # a path list (PYTHONPATH, PATH): each entry on its own
        return ":".join(_remap(part, mounts) for part in value.split(":"))
    for path, local in mounts.items():
        if value == path:
            return str(local)
        # A process node shares the host's files: a path that exists there below a mount
        # (a checkout under /tmp, where the pods' scratch emptyDir is mounted) is the
        # host's file the value names, not one inside the volume.
        if value.startswith(path + "/") and not Path(value).exists():
            return str(local) + value[len(path) :]
    return value


def _field_ref(pod: Mapping[str, Any], value_from: Mapping[str, Any]) -> str:
    path = str((value_from.get("fieldRef") or {}).get("fieldPath", ""))
    meta = pod["metadata"]
    spec = pod.get("spec") or {}
    # One host: every pod and node address is loopback.  A pod bound by a scheduler
    # names its node; a pod of `refit run` has none, and runs on "localhost".
    fields = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"],
        "spec.nodeName": spec.get("nodeName") or "localhost",
        "spec.serviceAccountName": spec.get("serviceAccountName") or "default",
        "status.podIP": "127.0.0.1",
        "status.hostIP": "127.0.0.1",
    }
    if path not in fields:
        raise KubeletError(f"pod {meta['name']}: unsupported downward API field {path!r}")
    return str(fields[path])


def _parent_death_kill() -> Callable[[], None]:
    """A ``preexec_fn`` asking Linux to SIGKILL the child when this process dies.

    Pods run in sessions of their own, so nothing else ends them if the parent is killed
    outright.  Linux sends it when the thread that started the child ends, so create pods
    from a thread that lives as long as they do (``refit run``'s main thread does).
    Resolved before the fork: the child only makes the system call.
    """
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return arm


_PR_SET_PDEATHSIG = 1


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
