"""What the cluster tier's tests share: kubectl and helm against the real control plane,
the operator as a local process on the chart's ServiceAccount token, and bounded waits.

Must not import: kopf, kubernetes (the operator runs as its own process).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tests.binaries import REPO_ROOT
from tests.chart_tools import CHART, Helm
from tests.cluster.controlplane import ControlPlane, free_port, kubeconfig
from tests.cluster.node import PodNetwork, ProcessNode
from tests.cluster.rest import Rest

from refit_worker.contract.waits import Backoff, poll_until

KUBECTL_TIMEOUT_S = 120.0
OPERATOR_NAMESPACE = "refit-system"
EXAMPLES = REPO_ROOT / "examples"
BACKOFF = Backoff(first=0.05, cap=0.5)


def wait(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """Poll ``check`` until it returns something truthy (an empty list is not an answer);
    fail naming ``what`` after ``timeout`` seconds."""
    return poll_until(
        lambda: check() or None, timeout=timeout, what=what, backoff=BACKOFF, error=AssertionError
    )


@dataclass
class Kubectl:
    """The real kubectl with a kubeconfig (the admin's unless told otherwise)."""

    binary: Path
    kubeconfig: Path

    def run(
        self,
        *args: str,
        stdin: str | None = None,
        kubeconfig: Path | None = None,
        timeout: float = KUBECTL_TIMEOUT_S,
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(kubeconfig or self.kubeconfig)}
        try:
            return subprocess.run(
                [str(self.binary), *args],
                input=stdin,
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"kubectl {' '.join(args)} ran past {timeout}s") from exc

    def ok(self, *args: str, **kw: Any) -> str:
        """Run; fail the test with kubectl's own error unless it exits 0."""
        done = self.run(*args, **kw)
        if done.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} exited {done.returncode}:\n{done.stderr}{done.stdout}"
            )
        return done.stdout

    def json(self, *args: str, **kw: Any) -> Any:
        return json.loads(self.ok(*args, "-o", "json", **kw))

    def apply(self, objects: Sequence[Mapping[str, Any]] | Mapping[str, Any], *args: str) -> str:
        docs = [objects] if isinstance(objects, Mapping) else objects
        return self.ok("apply", "-f", "-", *args, stdin=yaml.safe_dump_all([dict(d) for d in docs]))


@dataclass
class Cluster:
    """The session's control plane, its admin client and tools, and its process nodes."""

    plane: ControlPlane
    rest: Rest
    kubectl: Kubectl
    helm: Helm
    network: PodNetwork
    nodes: dict[str, ProcessNode] = field(default_factory=dict)
    workdir: Path = Path()

    def exit_codes(self) -> dict[tuple[str, str], int]:
        """(pod name, uid) -> exit code of every pod process any node ran."""
        out: dict[tuple[str, str], int] = {}
        for node in self.nodes.values():
            out.update(node.exit_codes)
        return out

    def gang(self, namespace: str, job: str, epoch: int) -> dict[tuple[str, str], str]:
        """(pod name, uid) -> node, for every pod of ``job``'s ``epoch`` a node started
        (the pods may be gone from the API since)."""
        return {
            (name, uid): node.name
            for node in self.nodes.values()
            for ns, name, uid, labels in node.started
            if ns == namespace
            and labels.get("refit.dev/job") == job
            and labels.get("refit.dev/epoch") == str(epoch)
        }

    def gang_exit_codes(self, namespace: str, job: str, epoch: int) -> dict[str, int]:
        """Pod name -> exit code of every rank of ``job``'s ``epoch``, once all ended."""
        pods = self.gang(namespace, job, epoch)
        assert pods, f"no node ran a pod of {namespace}/{job} epoch {epoch}"
        codes = wait(
            lambda: all(p in self.exit_codes() for p in pods) and self.exit_codes(),
            f"every rank of {job} epoch {epoch} to exit",
            timeout=60,
        )
        return {name: codes[(name, uid)] for name, uid in pods}

    def pod_log(self, name: str, uid: str) -> str:
        """The log a process node kept of pod ``name`` (``uid``)."""
        found = [
            path
            for node in self.nodes.values()
            for path in (node.workdir / "logs").glob(f"{name}-{uid[:8]}.log")
        ]
        assert len(found) == 1, (name, found)
        return found[0].read_text(errors="replace")

    def pod_kubeconfig(self, uid: str) -> Path:
        for node in self.nodes.values():
            if uid in node.kubeconfigs:
                return node.kubeconfigs[uid]
        raise LookupError(f"no node ran pod {uid} with a service-account token")

    def namespace(self, name: str) -> str:
        """Create namespace ``name`` (idempotent) and return it once pods can be created in
        it: the controller manager has made its ``default`` ServiceAccount."""
        self.kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        wait(
            lambda: self.rest.find(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
            f"the default ServiceAccount of namespace {name}",
            timeout=30,
        )
        return name

    def job_status(self, namespace: str, name: str) -> dict[str, Any]:
        job = self.rest.find(f"/apis/refit.dev/v1alpha1/namespaces/{namespace}/refitjobs/{name}")
        return dict((job or {}).get("status") or {})

    def pods(self, namespace: str, selector: str = "") -> list[dict[str, Any]]:
        params = {"labelSelector": selector} if selector else {}
        items: list[dict[str, Any]] = self.rest.get(
            f"/api/v1/namespaces/{namespace}/pods", **params
        )["items"]
        return items

    def diagnostics(self) -> str:
        parts = [self.plane.failure_report(lines=15)]
        for node in self.nodes.values():
            parts.append(f"--- node {node.name}: running {node.running}, errors {node.errors[-5:]}")
        return "\n".join(parts)


CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/refitjobs.refit.dev"


def wait_established(cluster: Cluster) -> None:
    """``kubectl wait --for=condition=Established`` on the RefitJob CRD, once the apiserver
    has given it conditions at all: kubectl 1.35 fails at once on a CRD whose status has
    none yet (a fresh, large CRD takes a moment), rather than waiting."""
    wait(
        lambda: ((cluster.rest.find(CRD_PATH) or {}).get("status") or {}).get("conditions"),
        "the apiserver to set the RefitJob CRD's conditions",
        timeout=60,
    )
    cluster.kubectl.ok(
        "wait", "--for=condition=Established", "crd/refitjobs.refit.dev", "--timeout=60s"
    )


def sa_kubeconfig(cluster: Cluster, account: str, namespace: str, path: Path) -> Path:
    """A kubeconfig holding a fresh token of ServiceAccount ``namespace/account``, made the
    way a user would: ``kubectl create token``."""
    token = cluster.kubectl.ok("create", "token", account, "-n", namespace, "--duration=2h")
    path.write_text(
        yaml.safe_dump(
            kubeconfig(cluster.plane.server, cluster.plane.ca_file, token.strip(), account)
        )
    )
    return path


class OperatorProcess:
    """``refit operator`` as a local process with the given kubeconfig; restartable."""

    def __init__(
        self, kubeconfig_path: Path, log: Path, *extra: str, env: Mapping[str, str] | None = None
    ) -> None:
        self.kubeconfig_path, self.log, self.extra = kubeconfig_path, log, extra
        self.env = dict(env or {})
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.port = 0  # /healthz, /readyz and /metrics, on 127.0.0.1

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self, *, ready: bool = True) -> None:
        """Start, and wait until it answers ``/healthz`` (and ``/readyz`` when ``ready``:
        a standby of a leader election is live but never leads, so not that)."""
        port = self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env.update(self.env)
        env["KUBECONFIG"] = str(self.kubeconfig_path)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT / "operator"), str(REPO_ROOT / "worker")]
        )
        with self.log.open("ab") as out:
            out.write(f"=== start {self.starts + 1} ===\n".encode())
            out.flush()
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "refit_operator.cli",
                    "operator",
                    f"--health-probe-bind-address=127.0.0.1:{port}",
                    f"--metrics-bind-address=127.0.0.1:{port}",
                    "--resync",
                    "10",
                    *self.extra,
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.starts += 1
        wait(lambda: self.answers("/healthz"), "the operator's liveness endpoint", timeout=60)
        if ready:
            wait(lambda: self.answers("/readyz"), "the operator to turn ready", timeout=60)

    def answers(self, path: str) -> bool:
        """Whether ``path`` answers 200 now; fails the test if the process has exited."""
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(
                f"the operator exited with {self.process.returncode}:\n{self.tail()}"
            )
        try:
            with urllib.request.urlopen(self.url(path), timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def get(self, path: str) -> str:
        """The body of ``GET path`` (an HTTP error fails the test)."""
        with urllib.request.urlopen(self.url(path), timeout=5) as r:
            return str(r.read().decode())

    def kill(self) -> int:
        """SIGKILL, as a node that dies or an OOM kill: nothing of the process runs on."""
        if self.process is None:
            raise AssertionError("the operator is not running")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        code = self.process.wait(10)
        self.process = None
        return code

    def stop(self) -> int | None:
        """SIGTERM, as the kubelet stops it; SIGKILL after 30 s. Returns the exit code."""
        if self.process is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            code = self.process.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait(10)
        self.process = None
        return code

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def forbidden(self) -> list[str]:
        """Lines where the apiserver answered the operator 403 (a right the chart lacks)."""
        return [line for line in self.text().splitlines() if "403" in line and "orbidden" in line]


def chart_values(path: Path, **values: Any) -> Path:
    """Values for the tests' install: the Deployment's pod must not run on a process node
    (the operator runs as a local process instead), so it selects a label no node has."""
    values = {"nodeSelector": {"refit.dev/operator-runs-outside-the-cluster": "true"}, **values}
    path.write_text(yaml.safe_dump(values))
    return path


@dataclass
class Install:
    release: str
    namespace: str
    operator: OperatorProcess
    kubeconfig: Path


def install_chart(
    cluster: Cluster,
    release: str,
    workdir: Path,
    watch_namespaces: tuple[str, ...] = (),
    *,
    start: bool = True,
) -> Install:
    """``helm install`` the chart, then start the operator on its ServiceAccount token,
    with the arguments the chart's Deployment gives it (``--namespace`` per watched one),
    without leader election (one operator process; ``start=False``: none yet).

    ``--take-ownership``: the CRD (a template of the chart, kept on uninstall) may be left
    by an earlier release of the session, as it is for a user who installs again."""
    workdir.mkdir(parents=True, exist_ok=True)
    done = cluster.helm.run(
        "install",
        release,
        str(CHART),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--create-namespace",
        "--values",
        str(chart_values(workdir / "values.yaml", watchNamespaces=list(watch_namespaces))),
        "--wait=false",
        "--take-ownership",
    )
    if done.returncode != 0:
        raise AssertionError(f"helm install failed ({done.returncode}):\n{done.stderr}")
    cluster.kubectl.ok(
        "wait", "--for=condition=Established", "crd/refitjobs.refit.dev", "--timeout=60s"
    )
    account = f"{release}-refit-operator"
    config = sa_kubeconfig(cluster, account, OPERATOR_NAMESPACE, workdir / "operator.kubeconfig")
    args = [f"--namespace={ns}" for ns in watch_namespaces]
    operator = OperatorProcess(config, workdir / "operator.log", *args)
    if start:
        operator.start()
    return Install(release, OPERATOR_NAMESPACE, operator, config)


def uninstall_chart(cluster: Cluster, install: Install) -> None:
    install.operator.stop()
    done = cluster.helm.run("uninstall", install.release, "--namespace", install.namespace)
    if done.returncode != 0:
        raise AssertionError(f"helm uninstall failed ({done.returncode}):\n{done.stderr}")


def example(name: str, **changes: Any) -> dict[str, Any]:
    """The RefitJob of ``examples/<name>.yaml`` with top-level metadata/spec changes.

    Its refits go back to back: an example's ``weights.synthetic.pace`` (one second per
    step, there for the README's drain demo) is dropped, as ``tests/e2e/test_refit_run.py``
    drops it, since it would add a second per refit to every test built on the example.
    A test that wants a pace sets one."""
    doc: dict[str, Any] = next(
        d
        for d in yaml.safe_load_all((EXAMPLES / f"{name}.yaml").read_text())
        if d and d.get("kind") == "RefitJob"
    )
    doc["spec"].get("weights", {}).get("synthetic", {}).pop("pace", None)
    for key, value in changes.items():
        doc[key] = value
    return doc


def elapsed(since: float) -> float:
    return round(time.monotonic() - since, 1)


def assert_bit_exact(codes: Mapping[str, int], ranks: int) -> None:
    """Every rollout rank exited 0: each checked every tensor bit for bit before it
    committed each refit (a mismatch exits 1).  A policy rank exits 0, or 83 when it was
    still winding down as the job turned Succeeded and the operator stopped it."""
    assert len(codes) == ranks, codes
    for name, code in codes.items():
        allowed = {0} if "-rollout-" in name else {0, 83}
        assert code in allowed, f"{name} exited {code}: {dict(codes)}"


#: Every kind of child a RefitJob has, and where to list them.
CHILD_KINDS = {
    "pods": "/api/v1/namespaces/{ns}/pods",
    "configmaps": "/api/v1/namespaces/{ns}/configmaps",
    "services": "/api/v1/namespaces/{ns}/services",
    "serviceaccounts": "/api/v1/namespaces/{ns}/serviceaccounts",
    "roles": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "rolebindings": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
}


class ChildWatch:
    """Every (kind, name, uid) of a job's children seen, and the job's refit counts.

    A thread polls the children for as long as :meth:`running` lasts and keeps every uid
    it ever saw, so a child created twice (a second pod of one name, a second ConfigMap)
    shows up even if it was deleted again before the end."""

    def __init__(self, cluster: Cluster, namespace: str, job: str) -> None:
        self.cluster, self.namespace, self.job = cluster, namespace, job
        self.seen: set[tuple[str, str, str]] = set()
        self.refits: list[int] = []
        self._stop = threading.Event()

    def children(self) -> dict[str, list[dict[str, Any]]]:
        out = {}
        for kind, path in CHILD_KINDS.items():
            listed = self.cluster.rest.get(
                path.format(ns=self.namespace), labelSelector=f"refit.dev/job={self.job}"
            )
            out[kind] = listed["items"]
        return out

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            for kind, items in self.children().items():
                self.seen |= {(kind, o["metadata"]["name"], o["metadata"]["uid"]) for o in items}
            refits = self.cluster.job_status(self.namespace, self.job).get("refitsCompleted")
            if refits is not None:
                self.refits.append(int(refits))

    @contextlib.contextmanager
    def running(self) -> Iterator[ChildWatch]:
        thread = threading.Thread(target=self._poll, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(10)

    def uids(self, kind: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for k, name, uid in self.seen:
            if k == kind:
                out.setdefault(name, set()).add(uid)
        return out


def run_to_completion(
    cluster: Cluster, namespace: str, manifest: Path, name: str, timeout_s: int = 1200
) -> dict[str, Any]:
    """``kubectl apply`` the job in ``manifest`` into ``namespace``, wait for its
    Complete condition, and return its status."""
    cluster.namespace(namespace)
    cluster.kubectl.ok("apply", "-n", namespace, "-f", str(manifest))
    cluster.kubectl.ok(
        "wait", "--for=condition=Complete", f"rj/{name}", "-n", namespace,
        f"--timeout={timeout_s}s", timeout=timeout_s + 30,
    )  # fmt: skip
    return cluster.job_status(namespace, name)
