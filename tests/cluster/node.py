"""A process node: the project's process kubelet as a real ``Node`` of the real apiserver.

:class:`ProcessNode` registers a ``Node`` (capacity, labels, taints, a Ready condition) and
renews its ``Lease`` in ``kube-node-lease``; it lists the pods kube-scheduler bound to it
(``spec.nodeName``) and runs each as a local process group with
:class:`refit_operator.local.kubelet.ProcessKubelet` (the code ``refit run`` uses), and
reports their status as a kubelet does (phase, the five pod conditions, container state
with exit code).  Deletion goes as on a kubelet: the pod's ``deletionGracePeriodSeconds``
bounds the preStop hook and the stop signal, and once the process group is gone the final
status is written and the pod is deleted with ``gracePeriodSeconds=0`` and a uid
precondition.

One host plays the cluster network (:class:`PodNetwork`, reusing ``refit run``'s
:func:`~refit_operator.local.runner.local_env` and
:class:`~refit_operator.local.runner.LoopbackPorts`): each job's roles meet on loopback
ports shared by every node.  A pod with a projected service-account token (what the
ServiceAccount admission plugin adds) gets a token from the TokenRequest API, bound to the
pod, and a per-pod kubeconfig in ``KUBECONFIG``: processes cannot see a file at
``/var/run/secrets/kubernetes.io/serviceaccount`` of their own, so the standard fallback
of the clients (``KUBECONFIG``) carries it instead; ``KUBERNETES_SERVICE_*`` and the test's
own ``KUBECONFIG`` are never passed on, and ``HOME`` is the node's, so no pod can fall back
on the test user's credentials.

Env ``valueFrom`` a Secret or ConfigMap key is read from the API when the pod starts, as a
kubelet does.  Images are not pulled, with one exception that lets tests see a pull fail:
an image whose registry host ends in ``.invalid`` (a top-level domain that never resolves,
RFC 2606) is reported ``ErrImagePull``, then ``ImagePullBackOff``, with the pod Pending and
no process started, as a kubelet reports an image it cannot fetch.

A node can die (:meth:`ProcessNode.die`): its heartbeat (Lease and status) stops, every
process group it runs is SIGKILLed, and nothing more is written, so its pods stay in the
API as they were, as a machine that lost power leaves them; the real node-lifecycle
controller then marks it ``Ready Unknown`` and taints it ``unreachable``.

Differences from a kubelet, on purpose: one container per pod (the first; a template's
sidecars are not run), no images (``command`` is run as is), processes run as the test's
user (``runAsUser`` is not applied), pod names are unique per node across namespaces.

Must not import: kopf, kubernetes.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from tests.cluster import nodeobjects as objects
from tests.cluster.controlplane import kubeconfig
from tests.cluster.rest import MERGE, STRATEGIC, ApiError, Rest, pod_path

from refit_operator.api import names
from refit_operator.local.kubelet import KubeletError, ProcessKubelet
from refit_operator.local.runner import LoopbackPorts, local_env

TICK_S = 0.2
#: Well inside kube-controller-manager's ``--node-monitor-grace-period`` (controlplane.py),
#: on a thread of its own: a slow pod sync must not make a live node look dead.
LEASE_RENEW_S = 1.0
STATUS_RENEW_S = 30.0
#: Ticks between a failed pull's ErrImagePull and its ImagePullBackOff (a kubelet waits ~10 s).
PULL_BACKOFF_TICKS = 10
DEFAULT_CAPACITY = {"cpu": "16", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "8"}
#: Never passed to a pod: the test's own credentials, or a real cluster's around the test.
_HOST_ONLY_ENV = ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")


class PodNetwork:
    """One host's pod network: a job's role meets on the same loopback port on every node."""

    def __init__(self) -> None:
        self._ports: dict[tuple[str, str], LoopbackPorts] = {}
        self._lock = threading.Lock()

    def env(
        self, pod: Mapping[str, Any], env: dict[str, str], *, weights_dir: Path | None = None
    ) -> dict[str, str]:
        labels = pod["metadata"].get("labels") or {}
        if names.LABEL_JOB not in labels:
            return env  # not a RefitJob pod: nothing to rewrite
        owners: list[dict[str, Any]] = pod["metadata"].get("ownerReferences") or [{}]
        owner = owners[0].get("uid", "")
        key = (str(pod["metadata"]["namespace"]), f"{labels[names.LABEL_JOB]}/{owner}")
        with self._lock:
            ports = self._ports.setdefault(key, LoopbackPorts())
            return local_env(env, port=ports.for_pod(pod), weights_dir=weights_dir)


class ProcessNode:
    """A node named ``name`` whose pods are local process groups under ``workdir``."""

    def __init__(
        self,
        name: str,
        rest: Rest,
        workdir: Path,
        network: PodNetwork,
        *,
        capacity: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        taints: list[dict[str, str]] | None = None,
    ) -> None:
        self.name, self.rest, self.workdir, self.network = name, rest, Path(workdir), network
        self.capacity = dict(capacity or DEFAULT_CAPACITY)
        self.labels, self.taints = dict(labels or {}), list(taints or [])
        env = {k: v for k, v in os.environ.items() if k not in _HOST_ONLY_ENV}
        # A home of the node's own, as a container has: the test user's ~/.kube/config
        # must not be a pod's fallback credentials.
        env["HOME"] = str(self.workdir / "home")
        (self.workdir / "home").mkdir(parents=True, exist_ok=True)
        self.kubelet = ProcessKubelet(
            self.workdir, rewrite_env=self._pod_env, base_env=env, env_source=self._env_from_api
        )
        #: pod name -> uid of the pod whose process runs (or ran) here under that name.
        self.running: dict[str, str] = {}
        #: (namespace, name, uid, labels) of every pod this node started, in order.
        self.started: list[tuple[str, str, str, dict[str, str]]] = []
        #: uid -> per-pod kubeconfig (service-account token), for tests that act as the pod.
        self.kubeconfigs: dict[str, Path] = {}
        #: uid -> the pod's conditions as last seen before the node deleted it for good.
        self.final_conditions: dict[str, list[dict[str, Any]]] = {}
        #: uid -> the environment the pod's process was started with.
        self.envs: dict[str, dict[str, str]] = {}
        #: uid -> how many times the node tried to pull the pod's unpullable image.
        self.pulls: dict[str, int] = {}
        #: Errors of the sync loop (the loop goes on; tests show them on failure).
        self.errors: list[str] = []
        self._reported: dict[str, str] = {}
        self._start_times: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._heart: threading.Thread | None = None
        self._booted = objects.now()

    @property
    def exit_codes(self) -> dict[tuple[str, str], int]:
        return self.kubelet.exit_codes

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> ProcessNode:
        node = objects.node_object(
            self.name, capacity=self.capacity, labels=self.labels, taints=self.taints
        )
        try:
            created = self.rest.post("/api/v1/nodes", node)
        except ApiError as exc:
            if exc.status != 409:
                raise
            created = self.rest.get(f"/api/v1/nodes/{self.name}")
        self._write_status()
        lease = objects.lease_object(created)
        try:
            self.rest.post(f"/apis/coordination.k8s.io/v1/namespaces/{lease_ns()}/leases", lease)
        except ApiError as exc:
            if exc.status != 409:
                raise
        self._thread = threading.Thread(target=self._loop, name=f"node-{self.name}", daemon=True)
        self._heart = threading.Thread(
            target=self._heartbeat, name=f"node-{self.name}-lease", daemon=True
        )
        self._thread.start()
        self._heart.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        for thread in (self._thread, self._heart):
            if thread is not None:
                thread.join(timeout)
        self.kubelet.close(timeout)

    def die(self, timeout: float = 30.0) -> list[int]:
        """As a machine that loses power: the heartbeat and the pod sync stop (nothing
        more is written to the API), then every process group the node runs is SIGKILLed.
        Returns the process groups killed."""
        self._stop.set()
        for thread in (self._thread, self._heart):
            if thread is not None:
                thread.join(timeout)
                if thread.is_alive():
                    raise RuntimeError(
                        f"node {self.name}: {thread.name} did not stop in {timeout}s"
                    )
        killed = []
        for pid in self.kubelet.pids().values():
            try:
                os.killpg(pid, signal.SIGKILL)  # each pod is its own session and group
            except ProcessLookupError:
                continue  # that pod's process had already ended
            killed.append(pid)
        return killed

    def _loop(self) -> None:
        last_status = time.monotonic()
        while not self._stop.wait(TICK_S):
            try:
                self.sync()
                now = time.monotonic()
                if now - last_status >= STATUS_RENEW_S:
                    self._write_status()
                    last_status = now
            except Exception as exc:  # a node keeps going; the error is kept for the test
                self._error(exc)

    def _heartbeat(self) -> None:
        while not self._stop.wait(LEASE_RENEW_S):
            try:
                self._renew_lease()
            except Exception as exc:
                self._error(exc)

    def _error(self, exc: Exception) -> None:
        self.errors.append(f"{type(exc).__name__}: {exc}")
        del self.errors[:-50]

    def _write_status(self) -> None:
        status = objects.node_status(self.name, self.capacity, self._booted)
        self.rest.patch(f"/api/v1/nodes/{self.name}/status", {"status": status}, MERGE)

    def _renew_lease(self) -> None:
        self.rest.patch(
            f"/apis/coordination.k8s.io/v1/namespaces/{lease_ns()}/leases/{self.name}",
            {"spec": {"renewTime": objects.micro_now(), "holderIdentity": self.name}},
            MERGE,
        )

    # -- pods ------------------------------------------------------------------------

    def sync(self) -> None:
        """One pass: start new pods, stop deleted ones, report what changed."""
        listed = self.rest.get("/api/v1/pods", fieldSelector=f"spec.nodeName={self.name}")
        pods = listed.get("items") or []
        local = {p["metadata"]["name"]: p for p in self.kubelet.pods()}
        for pod in pods:
            meta = pod["metadata"]
            name, uid = meta["name"], meta["uid"]
            mine = self.running.get(name) == uid
            if meta.get("deletionTimestamp"):
                if mine and name in local:
                    grace = meta.get("deletionGracePeriodSeconds")
                    self.kubelet.delete(name, grace_seconds=None if grace is None else float(grace))
                else:
                    self._finish(pod)
            elif not mine:
                if name in local or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                    continue  # the previous pod of that name is still stopping / not ours
                image = objects.unpullable_image(pod)
                if image is not None:
                    self._pull_fails(pod, image)
                    continue
                self._start(pod)
            elif name in local:
                self._report(pod, local[name])
        listed_names = {p["metadata"]["name"] for p in pods}
        for name in local:
            if name not in listed_names and name in self.running:
                self.kubelet.delete(name, grace_seconds=0)  # force-deleted from the API

    def _start(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        try:
            self._prepare_token(pod)
        except _NotYet:
            return  # e.g. kube-root-ca.crt not published yet: as ContainerCreating
        try:
            self.kubelet.create(pod)
        except KubeletError as exc:
            self.running[meta["name"]] = meta["uid"]
            self._put_status(pod, objects.start_error_status(pod, str(exc)))
            return
        self.running[meta["name"]] = meta["uid"]
        self._start_times[meta["uid"]] = objects.now()
        self.started.append(
            (meta["namespace"], meta["name"], meta["uid"], dict(meta.get("labels") or {}))
        )

    def _pull_fails(self, pod: dict[str, Any], image: str) -> None:
        """As a kubelet whose image pull fails: ErrImagePull, then ImagePullBackOff, the
        pod Pending; the process never starts."""
        uid = pod["metadata"]["uid"]
        tries = self.pulls.get(uid, 0) + 1
        self.pulls[uid] = tries
        if tries in (1, PULL_BACKOFF_TICKS):  # the failed pull, then the back-off
            reason = "ErrImagePull" if tries == 1 else "ImagePullBackOff"
            self._put_status(pod, objects.image_pull_status(pod, image, reason))

    def _report(self, pod: dict[str, Any], local: dict[str, Any]) -> None:
        status = objects.pod_status(pod, local)
        state = status["containerStatuses"][0]["state"]
        key = repr((pod["metadata"]["uid"], status["phase"], sorted(state), _exit(state)))
        if self._reported.get(pod["metadata"]["name"]) != key:
            self._put_status(pod, status)
            self._reported[pod["metadata"]["name"]] = key

    def _finish(self, pod: dict[str, Any]) -> None:
        """The pod's process is gone (or never ran): final status, then the last delete."""
        meta = pod["metadata"]
        name, uid = meta["name"], meta["uid"]
        self.final_conditions[uid] = list((pod.get("status") or {}).get("conditions") or [])
        code = self.kubelet.exit_codes.get((name, uid))
        if self.running.get(name) == uid and code is not None:
            local = _terminated(code, self._start_times.get(uid) or objects.now())
            try:
                self._put_status(pod, objects.pod_status(pod, local))
            except ApiError as exc:
                if exc.status not in (404, 409, 422):
                    raise
        options = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": uid},
        }
        try:
            self.rest.delete(pod_path(meta["namespace"], name), options)
        except ApiError as exc:
            if exc.status not in (404, 409):  # gone, or a new pod of that name
                raise
        if self.running.get(name) == uid:
            del self.running[name]
        self._reported.pop(name, None)
        secrets = self.workdir / "secrets" / uid
        shutil.rmtree(secrets, ignore_errors=True)

    def _put_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        meta = pod["metadata"]
        path = pod_path(meta["namespace"], meta["name"]) + "/status"
        body = {"metadata": {"uid": meta["uid"]}, "status": status}
        self.rest.patch(path, body, STRATEGIC)

    # -- service-account token -------------------------------------------------------

    def _prepare_token(self, pod: dict[str, Any]) -> None:
        source = objects.token_source(pod)
        if source is None:
            return
        meta = pod["metadata"]
        namespace = meta["namespace"]
        account = pod["spec"].get("serviceAccountName") or "default"
        root_ca = self.rest.find(f"/api/v1/namespaces/{namespace}/configmaps/kube-root-ca.crt")
        if root_ca is None:
            raise _NotYet
        answer = self.rest.post(
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
            objects.token_request(pod, source),
        )
        folder = self.workdir / "secrets" / meta["uid"]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "token").write_text(answer["status"]["token"])
        (folder / "ca.crt").write_text(root_ca["data"]["ca.crt"])
        (folder / "namespace").write_text(namespace)
        config = kubeconfig(self.rest.server, folder / "ca.crt", answer["status"]["token"], account)
        config["contexts"][0]["context"]["namespace"] = namespace  # type: ignore[index]
        path = folder / "kubeconfig"
        path.write_text(yaml.safe_dump(config))
        self.kubeconfigs[meta["uid"]] = path

    def _pod_env(self, pod: Mapping[str, Any], env: dict[str, str]) -> dict[str, str]:
        env = self.network.env(pod, env, weights_dir=self._weights_dir(pod))
        uid = str(pod["metadata"]["uid"])
        path = self.kubeconfigs.get(uid)
        env = {**env, "KUBECONFIG": str(path)} if path else env
        self.envs[uid] = dict(env)
        return env

    def _weights_dir(self, pod: Mapping[str, Any]) -> Path | None:
        """Where this node serves the pod's weights claim (the worker's config names the
        mount path, which a process cannot bind-mount; the node points it here)."""
        for volume in pod["spec"].get("volumes") or []:
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and (local := self.kubelet.claim_dir(str(claim))) is not None:
                return local
        return None

    def _env_from_api(self, pod: Mapping[str, Any], source: Mapping[str, Any]) -> str:
        """A ``secretKeyRef`` or ``configMapKeyRef`` read from the API, as a kubelet does."""
        namespace = str(pod["metadata"]["namespace"])
        for key, plural in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
            ref = source.get(key)
            if ref is None:
                continue
            found = self.rest.find(f"/api/v1/namespaces/{namespace}/{plural}/{ref['name']}")
            if found is None:
                raise _NotYet  # a kubelet retries until the object exists
            data = found.get("data") or {}
            if ref["key"] not in data:
                raise KubeletError(
                    f"CreateContainerConfigError: {plural[:-1]} {ref['name']!r} has no key"
                    f" {ref['key']!r}"
                )
            value = str(data[ref["key"]])
            return base64.b64decode(value).decode() if plural == "secrets" else value
        raise KubeletError(f"unsupported env source {sorted(source)}")


class _NotYet(Exception):
    """Something the pod needs is not in the API yet; try again next tick."""


def lease_ns() -> str:
    return objects.LEASE_NAMESPACE


def _exit(state: Mapping[str, Any]) -> int | None:
    terminated = state.get("terminated")
    return None if terminated is None else int(terminated["exitCode"])


def _terminated(code: int, started: str) -> dict[str, Any]:
    return {
        "status": {
            "phase": "Succeeded" if code == 0 else "Failed",
            "startTime": started,
            "containerStatuses": [
                {
                    "state": {
                        "terminated": {
                            "exitCode": code,
                            "reason": "Completed" if code == 0 else "Error",
                            "finishedAt": objects.now(),
                        }
                    }
                }
            ],
        }
    }
