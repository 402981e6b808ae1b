"""``refit run`` as a user runs it: a subprocess on a manifest, real worker processes, real
NIXL, real signals, the file-backed rendezvous.  Nothing is emulated.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tests.support.processes import processes_under

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "worker")]),
    "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
}


def _manifest(tmp_path: Path, **spec_overrides: object) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())
    doc["metadata"]["name"] = "e2e-run"
    for dotted, value in spec_overrides.items():
        node = doc["spec"]
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "refit_operator.cli", "run", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_success_with_verification(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    done = _run([str(_manifest(tmp_path, **{"transfer.refits": 2})), "--workdir", str(workdir)])
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "phase=Succeeded" in out
    assert "refits 2/2" in out and "preemptions 0" in out
    assert "verification: bit-exact" in out
    assert not processes_under(workdir)


def test_drain_preempts_and_completes(tmp_path: Path) -> None:
    path = _manifest(tmp_path, **{"transfer.refits": 2})
    done = _run([str(path), "--drain-after", "1", "--plain"])
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "reason=Drain draining e2e-run-rollout-0" in out
    assert "epoch=1" in out  # a new gang came up
    assert "preemptions 1 (drained e2e-run-rollout-0)" in out
    assert "restarts 0" in out
    assert "verification: bit-exact" in out


def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "refit_operator.cli",
            "run",
            str(_manifest(tmp_path, **{"transfer.refits": 100_000})),
            "--workdir",
            str(workdir),
        ],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(processes_under(workdir)) < 4:  # all four ranks are up
            assert time.monotonic() < deadline, "the gang never started"
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.2)
        workers = processes_under(workdir)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "interrupted; every worker was stopped" in out
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not processes_under(workdir)
    assert not list((workdir / "pods").iterdir())  # no pod's files left behind


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "apiVersion: refit.dev/v1alpha1\nkind: RefitJob\nmetadata: {name: x}\nspec: [\n",
            "not valid YAML",
        ),
        (
            "apiVersion: refit.dev/v1alpha1\nkind: RefitJob\nmetadata: {name: x}\n"
            "spec: {image: i, transfer: {bucketSize: '0'}}\n",
            "bucketSize",
        ),
        (
            "apiVersion: refit.dev/v1alpha1\nkind: RefitJob\nmetadata: {name: x}\n"
            "spec: {image: i, preemption: {signal: SIGNOPE}}\n",
            "SIGNOPE",
        ),
        (
            "apiVersion: refit.dev/v1alpha1\nkind: RefitJob\nmetadata: {name: x}\n"
            "spec: {image: i, rollout: {replicas: 0}}\n",
            "replicas",
        ),
        (
            "apiVersion: refit.dev/v1alpha1\nkind: RefitJob\nmetadata: {name: x}\n"
            "spec: {image: i, surprise: 1}\n",
            "surprise",
        ),
        ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", "kind RefitJob"),
    ],
)
def test_bad_manifest_starts_nothing(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    workdir = tmp_path / "work"
    done = _run([str(path), "--workdir", str(workdir)], timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert expected in done.stderr
    assert not workdir.exists()  # nothing was started, not even a working directory
