"""``refit run --status-file PATH``: the final RefitJob as JSON, written whatever the
outcome; a path that cannot take it is refused before anything starts.

Real: the command's argument parsing, manifest loading and the file it writes, in
tmp_path.  Emulated: the run itself (``run_job`` replaced by one that returns a result),
so no worker starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from refit_operator.api.models import PodBytes, RefitJobStatus
from refit_operator.cli import main
from refit_operator.core.decision import JobView
from refit_operator.local import command, status_file
from refit_operator.local.runner import RunResult
from refit_operator.render.pods import JobRef

ROOT = Path(__file__).resolve().parents[2]


def _manifest(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text((ROOT / "examples" / "local.yaml").read_text())
    return path


class FakeRun:
    """``run_job`` that ends at once with ``phase`` and the spec scaled to 1 replica."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.calls = 0

    def __call__(self, manifest: Any, spec: Any, options: Any, **kw: Any) -> RunResult:
        self.calls += 1
        status = RefitJobStatus(
            phase=self.phase,
            refits_completed=3,
            bytes_counted=[PodBytes(uid="a", bytes=100), PodBytes(uid="b", bytes=50)],
            bytes_transferred=150,
        )
        scaled = {**manifest["spec"], "rollout": {"replicas": 1}}
        job = JobView(JobRef("local-demo", "default", "uid-1"), 2, scaled, status)
        return RunResult(status, job=job)


@pytest.mark.parametrize(("phase", "code"), [("Succeeded", 0), ("Failed", 1)])
def test_the_final_job_is_written_as_kubectl_would_print_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str, code: int
) -> None:
    monkeypatch.setattr(command, "run_job", FakeRun(phase))
    out = tmp_path / "status.json"
    assert main(["run", str(_manifest(tmp_path)), "--plain", "--status-file", str(out)]) == code
    job = json.loads(out.read_text())
    assert list(job) == ["apiVersion", "kind", "metadata", "spec", "status"]
    assert (job["apiVersion"], job["kind"]) == ("refit.dev/v1alpha1", "RefitJob")
    assert job["metadata"] == {
        "name": "local-demo",
        "namespace": "default",
        "uid": "uid-1",
        "generation": 2,
    }
    assert job["spec"]["rollout"] == {"replicas": 1}  # the spec as the run left it
    status = job["status"]
    assert (status["phase"], status["refitsCompleted"], status["bytesTransferred"]) == (
        phase,
        3,
        150,
    )
    assert status["bytesCounted"] == [{"uid": "a", "bytes": 100}, {"uid": "b", "bytes": 50}]
    assert None not in status.values()  # no nulls, as the API server stores none
    assert [p.name for p in tmp_path.iterdir()] == ["job.yaml", "status.json"]


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("missing/status.json", "does not exist"),
        ("job.yaml/status.json", "is not a directory"),
        (".", "is a directory"),
    ],
)
def test_a_path_that_cannot_take_it_is_refused_before_the_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    where: str,
    expected: str,
) -> None:
    fake = FakeRun("Succeeded")
    monkeypatch.setattr(command, "run_job", fake)
    manifest = _manifest(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    path = tmp_path / where
    assert main(["run", str(manifest), "--plain", "--status-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("refit run: --status-file ") and expected in err, err
    assert fake.calls == 0  # nothing ran
    assert sorted(tmp_path.rglob("*")) == before  # nothing was created


def test_an_unwritable_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(status_file.os, "access", lambda path, mode: False)
    problem = status_file.problem(tmp_path / "status.json")
    assert problem is not None and "is not writable" in problem
    monkeypatch.undo()
    assert status_file.problem(tmp_path / "status.json") is None
    assert list(tmp_path.iterdir()) == []  # looking created nothing


def test_help_explains_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--status-file PATH" in text and "kubectl get -o json" in text
    assert "whether the job succeeded or failed" in text
