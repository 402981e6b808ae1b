"""The process kubelet: real processes, real signals, real preStop hooks.

Nothing is emulated except the node itself (emptyDir = a temp directory).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from refit_operator.local.kubelet import KubeletError, ProcessKubelet

_TERM_AWARE = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
    "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(9))\n"
    "print('up', flush=True)\n"
    "time.sleep(60)\n"
)
_STUBBORN = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"


def _pod(name: str, code: str, **container: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns1", "labels": {}},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "main", "command": [sys.executable, "-c", code], **container}],
        },
    }


def _wait_status(kubelet: ProcessKubelet, name: str, phase: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pods = {p["metadata"]["name"]: p for p in kubelet.pods()}
        if name in pods and pods[name]["status"]["phase"] == phase:
            return pods[name]
        time.sleep(0.05)
    raise AssertionError(f"pod {name} never reached {phase}: {kubelet.pods()}")


def _wait_gone(kubelet: ProcessKubelet, name: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if name not in {p["metadata"]["name"] for p in kubelet.pods()}:
            return
        time.sleep(0.05)
    raise AssertionError(f"pod {name} still present after {timeout}s")


def test_exit_codes_and_downward_api(tmp_path: Path) -> None:
    kubelet = ProcessKubelet(tmp_path)
    code = (
        "import os, sys\n"
        "sys.exit(0 if os.environ['ME'] == 'p0' and os.environ['NS'] == 'ns1'"
        " and len(os.environ['UID']) == 36 else 3)\n"
    )
    env = [
        {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
    ]
    kubelet.create(_pod("p0", code, env=env))
    kubelet.create(_pod("p1", "import sys; sys.exit(4)"))
    try:
        assert (
            _wait_status(kubelet, "p0", "Succeeded")["status"]["containerStatuses"][0]["state"][
                "terminated"
            ]["exitCode"]
            == 0
        )
        failed = _wait_status(kubelet, "p1", "Failed")
        assert failed["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 4
        with pytest.raises(KubeletError, match="already exists"):
            kubelet.create(_pod("p1", "pass"))
    finally:
        kubelet.close()


def test_delete_sends_stop_signal_then_sigkill(tmp_path: Path) -> None:
    kubelet = ProcessKubelet(tmp_path)
    kubelet.create(_pod("polite", _TERM_AWARE, lifecycle={"stopSignal": "SIGUSR1"}))
    stubborn = _pod("stubborn", _STUBBORN)
    stubborn["spec"]["terminationGracePeriodSeconds"] = 1
    kubelet.create(stubborn)
    try:
        _wait_status(kubelet, "polite", "Running")
        time.sleep(0.5)  # let the handlers install
        started = time.monotonic()
        kubelet.delete("polite")
        kubelet.delete("stubborn")
        pods = {p["metadata"]["name"]: p for p in kubelet.pods()}
        assert all("deletionTimestamp" in p["metadata"] for p in pods.values())
        _wait_gone(kubelet, "polite")
        _wait_gone(kubelet, "stubborn")
        # SIGKILL came at the grace period, not before and not much after.
        assert 0.9 <= time.monotonic() - started < 8
    finally:
        kubelet.close()


def test_prestop_hook_runs_with_pod_env_and_empty_dir(tmp_path: Path) -> None:
    # The hook writes into the emptyDir mount (remapped locally) and the main process,
    # which ignores SIGTERM, exits when it sees the file: proof the hook ran first.
    main = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "flag = os.path.join(os.environ['SHARED'], 'flag')\n"
        "while not os.path.exists(flag): time.sleep(0.02)\n"
        "sys.exit(0)\n"
    )
    hook = [
        sys.executable,
        "-c",
        "import os; open(os.path.join(os.environ['SHARED'], 'flag'), 'w').close()",
    ]
    pod = _pod(
        "hooked",
        main,
        env=[{"name": "SHARED", "value": "/var/run/refit"}],
        volumeMounts=[{"name": "signals", "mountPath": "/var/run/refit"}],
        lifecycle={"preStop": {"exec": {"command": hook}}},
    )
    pod["spec"]["volumes"] = [{"name": "signals", "emptyDir": {}}]
    kubelet = ProcessKubelet(tmp_path)
    try:
        kubelet.create(pod)
        _wait_status(kubelet, "hooked", "Running")
        started = time.monotonic()
        kubelet.delete("hooked")
        _wait_gone(kubelet, "hooked")
        assert time.monotonic() - started < 4  # well inside the 5 s grace: no SIGKILL needed
        assert not list((tmp_path / "pods").iterdir())  # the emptyDir went with the pod
    finally:
        kubelet.close()


def test_disrupt_marks_disruption_target(tmp_path: Path) -> None:
    kubelet = ProcessKubelet(tmp_path)
    kubelet.create(_pod("victim", _TERM_AWARE))
    try:
        _wait_status(kubelet, "victim", "Running")
        time.sleep(0.3)
        kubelet.disrupt("victim")
        pod = {p["metadata"]["name"]: p for p in kubelet.pods()}.get("victim")
        if pod is not None:  # it may already be gone; if not, it must carry the condition
            types = {c["type"]: c for c in pod["status"]["conditions"]}
            assert types["DisruptionTarget"]["reason"] == "EvictionByEvictionAPI"
        _wait_gone(kubelet, "victim")
    finally:
        kubelet.close()


def test_close_leaves_no_process(tmp_path: Path) -> None:
    import os

    kubelet = ProcessKubelet(tmp_path)
    kubelet.create(_pod("a", _STUBBORN))
    kubelet.create(_pod("b", _TERM_AWARE))
    _wait_status(kubelet, "a", "Running")
    pids = kubelet.pids()
    for name in ("a", "b"):
        kubelet._pods[name].manifest["spec"]["terminationGracePeriodSeconds"] = 1
    uids = {name: pod.manifest["metadata"]["uid"] for name, pod in kubelet._pods.items()}
    kubelet.close(timeout=10)
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # Each exit is recorded, as for pods reaped while running.  A process stopped before
    # it set its handler dies of SIGTERM (143); after, b exits 7 and a, which ignores it,
    # is SIGKILLed (137).
    codes = kubelet.exit_codes
    assert set(codes) == {("a", uids["a"]), ("b", uids["b"])}
    assert codes[("a", uids["a"])] in {143, 137} and codes[("b", uids["b"])] in {143, 7}


def test_bad_manifests(tmp_path: Path) -> None:
    kubelet = ProcessKubelet(tmp_path)
    with pytest.raises(KubeletError, match="no containers"):
        kubelet.create({"metadata": {"name": "x"}, "spec": {"containers": []}})
    with pytest.raises(KubeletError, match="cannot start"):
        kubelet.create(
            {
                "metadata": {"name": "y"},
                "spec": {"containers": [{"command": ["/nonexistent/binary"]}]},
            }
        )
    assert kubelet.pods() == []


def test_an_env_source_this_node_cannot_read_is_named(tmp_path: Path) -> None:
    """Without an ``env_source`` hook a Secret reference is named as such (it used to be
    reported as an unsupported downward API field '')."""
    kubelet = ProcessKubelet(tmp_path)
    env = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
    try:
        with pytest.raises(KubeletError, match=r"env TOKEN: valueFrom secretKeyRef is not"):
            kubelet.create(_pod("p0", "pass", env=env))
        assert kubelet.pods() == []
    finally:
        kubelet.close()
