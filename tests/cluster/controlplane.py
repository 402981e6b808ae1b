"""A real Kubernetes control plane on 127.0.0.1: etcd, kube-apiserver, kube-controller-manager
and kube-scheduler, as built by ``tests/cluster/build.sh``.

:func:`build` runs the script (a warm cache answers in a second; a cold one builds for
several minutes) and returns the binary directory; a missing Go toolchain or a failed build
raises :class:`ControlPlaneError` with the script's own message.  :class:`ControlPlane`
starts the four components, each bound to 127.0.0.1 on a free port with its log in the
work directory, waits until each answers its health endpoint (every wait bounded and named),
and stops them by pid; :meth:`ControlPlane.failure_report` gives the tail of every log.

Authentication: one static admin token in group ``system:masters`` (``--token-auth-file``);
the components use it through kubeconfigs.  Authorization: RBAC.  Service-account tokens are
signed with an RSA key made by ``openssl`` here; the controller manager holds the private
key (token controller, per-controller credentials) and the apiserver's self-signed serving
certificate as the cluster's root CA (the ``kube-root-ca.crt`` ConfigMaps).

Must not import: the operator, kopf (stdlib, yaml, and the worker's bounded waits).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from refit_worker.contract.waits import Backoff, WaitTimeout, poll_until

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build.sh"
#: A cold build is ~10 min of 2 cores; a warm cache answers at once.
BUILD_TIMEOUT_S = 45 * 60
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 15.0
ADMIN_USER = "kube-refit-admin"
SERVICE_CIDR = "10.0.0.0/24"
ISSUER = "https://kubernetes.default.svc"
#: kube-controller-manager's node monitor: a node whose Lease is not renewed for the grace
#: period is marked Ready Unknown (and tainted unreachable), looked at every period.  Short
#: for tests (the defaults are 50 s and 5 s); the process nodes renew every second.
NODE_MONITOR_GRACE_S = 10
NODE_MONITOR_PERIOD_S = 1


class ControlPlaneError(RuntimeError):
    """The control plane could not be built or started; the message says which part."""


@dataclass(frozen=True)
class Build:
    bin_dir: Path
    seconds: float
    output: str


def build(script: Path = BUILD_SCRIPT) -> Build:
    """Run ``build.sh``; its stderr (progress, timings) comes back in :attr:`Build.output`."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            ["bash", str(script)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise ControlPlaneError(
            f"{script} did not finish within {BUILD_TIMEOUT_S} s: {exc.stderr!r}"
        ) from exc
    if done.returncode != 0:
        raise ControlPlaneError(
            f"{script} failed (exit {done.returncode}); the cluster tier needs the real "
            f"control plane and does not skip:\n{done.stderr}"
        )
    bin_dir = Path(done.stdout.strip().splitlines()[-1])
    return Build(bin_dir, time.monotonic() - started, done.stderr)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kubeconfig(server: str, ca_file: Path, token: str, user: str) -> dict[str, object]:
    """A one-context kubeconfig that trusts ``ca_file`` and presents ``token``."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "local", "cluster": {"server": server, "certificate-authority": str(ca_file)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }


@dataclass
class _Component:
    name: str
    process: subprocess.Popen[bytes]
    log: Path


@dataclass
class ControlPlane:
    """The four components under ``workdir``; use as a context manager."""

    bin_dir: Path
    workdir: Path
    ports: dict[str, int] = field(default_factory=dict)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    _components: list[_Component] = field(default_factory=list)

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    @property
    def ca_file(self) -> Path:
        """The apiserver's self-signed certificate (and its CA): what clients trust."""
        return self.workdir / "certs" / "apiserver.crt"

    @property
    def kubeconfig_path(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def sa_key(self) -> Path:
        return self.workdir / "sa.key"

    def __enter__(self) -> ControlPlane:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- start -----------------------------------------------------------------------

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        self._make_keys()
        for name in ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler"):
            self.ports[name] = free_port()
        self._start("etcd", self._etcd_args())
        self._wait_http(
            "etcd", f"http://127.0.0.1:{self.ports['etcd']}/health", lambda body: '"true"' in body
        )
        self._start("kube-apiserver", self._apiserver_args())
        self._wait_http("kube-apiserver", f"{self.server}/readyz", lambda body: body == "ok")
        self.kubeconfig_path.write_text(
            yaml.safe_dump(kubeconfig(self.server, self.ca_file, self.token, ADMIN_USER))
        )
        self._start("kube-controller-manager", self._controller_manager_args())
        self._start("kube-scheduler", self._scheduler_args())
        for name, port in (
            ("kube-controller-manager", self.ports["controller-manager"]),
            ("kube-scheduler", self.ports["scheduler"]),
        ):
            self._wait_http(name, f"https://127.0.0.1:{port}/healthz", lambda b: b == "ok")

    def _make_keys(self) -> None:
        (self.workdir / "certs").mkdir(exist_ok=True)
        (self.workdir / "tokens.csv").write_text(
            f'{self.token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
        )
        if shutil.which("openssl") is None:
            raise ControlPlaneError("openssl is not on PATH; it makes the service-account key")
        for argv in (
            ["openssl", "genrsa", "-out", str(self.sa_key), "2048"],
            ["openssl", "rsa", "-in", str(self.sa_key), "-pubout", "-out", str(self.sa_pub)],
        ):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
            if done.returncode != 0:
                raise ControlPlaneError(f"{' '.join(argv)} failed: {done.stderr}")

    @property
    def sa_pub(self) -> Path:
        return self.workdir / "sa.pub"

    def _etcd_args(self) -> list[str]:
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        peer = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        return [
            str(self.bin_dir / "etcd"),
            "--name=default",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            # Test data: durability across a power cut is not worth an fsync per write.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]

    def _apiserver_args(self) -> list[str]:
        return [
            str(self.bin_dir / "kube-apiserver"),
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.ports['apiserver']}",
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
            f"--cert-dir={self.workdir / 'certs'}",
            f"--token-auth-file={self.workdir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={ISSUER}",
            f"--service-account-key-file={self.sa_pub}",
            f"--service-account-signing-key-file={self.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--endpoint-reconciler-type=none",
            # The process nodes honour lifecycle.stopSignal; let the API keep the field.
            "--feature-gates=ContainerStopSignals=true",
        ]

    def _component_kubeconfig(self) -> str:
        return str(self.kubeconfig_path)

    def _controller_manager_args(self) -> list[str]:
        kubeconfig_path = self._component_kubeconfig()
        return [
            str(self.bin_dir / "kube-controller-manager"),
            f"--kubeconfig={kubeconfig_path}",
            f"--authentication-kubeconfig={kubeconfig_path}",
            f"--authorization-kubeconfig={kubeconfig_path}",
            # No client CA to look up: the health probes are on always-allowed paths.
            "--authentication-skip-lookup=true",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports['controller-manager']}",
            f"--cert-dir={self.workdir / 'certs-kcm'}",
            f"--service-account-private-key-file={self.sa_key}",
            f"--root-ca-file={self.ca_file}",
            "--use-service-account-credentials=true",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--leader-elect=false",
            # A node that stops renewing its Lease is Ready Unknown this soon (default 50 s).
            f"--node-monitor-grace-period={NODE_MONITOR_GRACE_S}s",
            f"--node-monitor-period={NODE_MONITOR_PERIOD_S}s",
            # Every controller but the EndpointSlice ones: the process nodes' pod IPs are
            # loopback, which an EndpointSlice may not hold (no DNS here; see node.py).
            "--controllers=*,-endpointslice-controller,-endpointslice-mirroring-controller",
            "--feature-gates=ContainerStopSignals=true",
        ]

    def _scheduler_args(self) -> list[str]:
        kubeconfig_path = self._component_kubeconfig()
        return [
            str(self.bin_dir / "kube-scheduler"),
            f"--kubeconfig={kubeconfig_path}",
            f"--authentication-kubeconfig={kubeconfig_path}",
            f"--authorization-kubeconfig={kubeconfig_path}",
            "--authentication-skip-lookup=true",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports['scheduler']}",
            f"--cert-dir={self.workdir / 'certs-scheduler'}",
            "--leader-elect=false",
        ]

    def _start(self, name: str, argv: list[str]) -> None:
        log = self.workdir / "logs" / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.workdir,
            )
        self._components.append(_Component(name, process, log))

    def _wait_http(self, name: str, url: str, ok: Callable[[str], bool]) -> None:
        """Poll ``url`` until ``ok(body)``; fail naming the component, URL and last answer."""
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # a health probe; clients verify (kubeconfig)
        component = next(c for c in self._components if c.name == name)
        last = ["no answer yet"]

        def answered() -> bool:
            if component.process.poll() is not None:
                raise ControlPlaneError(
                    f"{name} exited with {component.process.returncode} before {url} "
                    f"answered\n{self.failure_report()}"
                )
            request = urllib.request.Request(url)
            if url.startswith(self.server):
                request.add_header("Authorization", f"Bearer {self.token}")
            try:
                with urllib.request.urlopen(request, timeout=5, context=context) as response:
                    body = response.read().decode(errors="replace").strip()
            except (urllib.error.URLError, OSError) as exc:
                last[0] = str(exc)
                return False
            last[0] = f"HTTP {response.status}: {body[:200]}"
            return ok(body)

        try:
            poll_until(
                answered,
                timeout=READY_TIMEOUT_S,
                what=f"{name} to answer {url}",
                backoff=Backoff(first=0.05, cap=0.5),
            )
        except WaitTimeout as exc:
            raise ControlPlaneError(f"{exc} (last: {last[0]})\n{self.failure_report()}") from None

    # -- stop and report ---------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM each component, newest first, waiting for each before the next (the
        apiserver's shutdown still talks to etcd); SIGKILL one that outlives the timeout."""
        for component in reversed(self._components):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(component.process.pid, signal.SIGTERM)
            try:
                component.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(component.process.pid, signal.SIGKILL)
                component.process.wait(10)
        self._components.clear()

    def pids(self) -> dict[str, int]:
        return {c.name: c.process.pid for c in self._components}

    def logs(self) -> Iterator[tuple[str, Path]]:
        for component in self._components:
            yield component.name, component.log

    def failure_report(self, lines: int = 30) -> str:
        """The tail of every component's log, for a failed start or test."""
        parts = []
        for name, log in self.logs():
            text = log.read_text(errors="replace").splitlines() if log.exists() else []
            parts.append(f"--- {name} ({log}), last {lines} lines ---")
            parts.extend(text[-lines:])
        return "\n".join(parts)

    def version(self) -> dict[str, str]:
        """The apiserver's /version (what ``kubectl version`` parses)."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        request = urllib.request.Request(f"{self.server}/version")
        request.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            answer: dict[str, str] = json.loads(response.read())
        return answer
