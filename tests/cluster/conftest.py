"""The cluster tier: a real control plane (built by ``build.sh``, or reused from its cache)
and two process nodes, shared by the whole session; each module installs the chart and
runs the operator it needs.

Real: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, helm, kubectl, the
operator process, the workers (NIXL, gloo, signals).  Played: the kubelet (the process
node, ``node.py``), the pod network (loopback).  A missing Go toolchain or a failed build
fails the session's first test with the build's own message: this tier never skips.

A failed test gets the tail of every component's log and each node's last errors.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.binaries import ensure_tools
from tests.chart_tools import Helm
from tests.cluster import records
from tests.cluster.controlplane import ControlPlane, ControlPlaneError, build
from tests.cluster.node import PodNetwork, ProcessNode
from tests.cluster.rest import Rest
from tests.cluster.support import Cluster, Install, Kubectl, install_chart, uninstall_chart

HERE = Path(__file__).resolve().parent
NODE_NAMES = ("node-a", "node-b")
_TIMES: dict[str, float] = {}
_SESSION: dict[str, Any] = {}


def _in_tier(item: pytest.Item) -> bool:
    return HERE in item.path.parents


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build (or find cached) the control plane once collection says the tier will run:
    here, not in the fixture, so a cold build's minutes are not charged to the first
    test's timeout.  A failure is kept and raised by the fixture, failing every test."""
    if not any(_in_tier(item) for item in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            "cluster tier: building or reusing the control plane (tests/cluster/build.sh; "
            "the first build takes several minutes)"
        )
    try:
        _SESSION["build"] = build()
    except ControlPlaneError as exc:
        _SESSION["build_error"] = exc


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    if "build_error" in _SESSION:
        raise _SESSION["build_error"]
    built = _SESSION.get("build") or build()
    _TIMES["build"] = built.seconds
    _TIMES["build_cached"] = float("cached:" in built.output)
    started = time.monotonic()
    plane = ControlPlane(built.bin_dir, tmp_path_factory.mktemp("control-plane"))
    _SESSION["plane"] = plane
    try:
        plane.start()
        _TIMES["start"] = time.monotonic() - started
        _TIMES["tier_started"] = time.monotonic()
        yield plane
    finally:
        _shutdown()


@pytest.fixture(scope="session")
def cluster(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    tools = ensure_tools()
    workdir = tmp_path_factory.mktemp("cluster")
    rest = Rest(control_plane.server, control_plane.token, control_plane.ca_file)
    helm = Helm(tools.helm, workdir / "helm-home")
    helm.env["KUBECONFIG"] = str(control_plane.kubeconfig_path)
    network = PodNetwork()
    cluster = Cluster(
        plane=control_plane,
        rest=rest,
        kubectl=Kubectl(tools.kubectl, control_plane.kubeconfig_path),
        helm=helm,
        network=network,
        workdir=workdir,
    )
    _SESSION["cluster"] = cluster
    try:
        for name in NODE_NAMES:
            cluster.nodes[name] = ProcessNode(name, rest, workdir / name, network).start()
        yield cluster
    finally:
        _shutdown()


def _shutdown() -> None:
    """Stop the nodes' pods, then the control plane (idempotent)."""
    cluster = _SESSION.pop("cluster", None)
    if cluster is not None:
        for node in cluster.nodes.values():
            node.stop()
    plane = _SESSION.pop("plane", None)
    if plane is not None:
        plane.stop()
        _SESSION["down"] = True
        if "tier_started" in _TIMES:
            _TIMES["tier"] = time.monotonic() - _TIMES["tier_started"]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the tier's last test (its module fixtures already torn down), stop the
    control plane and the nodes, so the tiers that run next have the machine to themselves.
    The session-scoped fixtures stay cached but dead; :func:`_alive` guards against use."""
    if _in_tier(item) and (nextitem is None or not _in_tier(nextitem)):
        _shutdown()


@pytest.fixture(autouse=True)
def _alive() -> None:
    if _SESSION.get("down"):
        raise RuntimeError(
            "the control plane was stopped after the cluster tier's last test; run the "
            "cluster tests together (they are one folder, collected in order)"
        )


@pytest.fixture(scope="module")
def install(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Install]:
    """The chart installed with helm and the operator running on its ServiceAccount's
    token, for one module (one operator at a time: kopf peering is off)."""
    installed = install_chart(cluster, "refit", tmp_path_factory.mktemp("install"))
    _SESSION["operator"] = installed
    try:
        yield installed
    finally:
        _SESSION.pop("operator", None)
        uninstall_chart(cluster, installed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    report = yield
    cluster = _SESSION.get("cluster")
    if cluster is not None and report.failed and _in_tier(item):  # type: ignore[attr-defined]
        report.sections.append(("control plane and nodes", cluster.diagnostics()))  # type: ignore[attr-defined]
        installed = _SESSION.get("operator")
        if installed is not None:
            report.sections.append(("operator log", installed.operator.tail(60)))  # type: ignore[attr-defined]
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if "build" not in _TIMES:
        return
    how = "reused from the cache" if _TIMES.get("build_cached") else "built"
    line = (
        f"cluster tier: control plane {how} in {_TIMES['build']:.1f} s, "
        f"started in {_TIMES.get('start', 0.0):.1f} s"
    )
    if "tier" in _TIMES:
        line += f", tests ran {_TIMES['tier']:.1f} s against it"
    terminalreporter.write_line(line)
    for what, text in records.LINES:
        terminalreporter.write_line(f"cluster tier: {what}: {text}")
