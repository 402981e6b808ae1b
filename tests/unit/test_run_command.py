"""``refit`` and ``refit run`` refusing bad input before anything starts.

Real: the command's own argument parsing and manifest loading, on files in tmp_path.
Nothing here starts a worker: every case ends before the runner.
"""

from __future__ import annotations

import argparse
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from refit_operator.api.models import RefitJobStatus, parse_spec
from refit_operator.cli import main
from refit_operator.local import view, workdir
from refit_operator.local.runner import RunResult

ROOT = Path(__file__).resolve().parents[2]


def _local(tmp_path: Path, **spec: object) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())
    doc["spec"].update(spec)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``refit ARGV``; it must exit 2 (argparse or the command) and say why on stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    assert code == 2, captured
    assert "Traceback" not in captured.err
    return captured.err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--drain-after", "nan"], "'nan': must be a finite number >= 0"),
        (["--drain-after", "inf"], "'inf': must be a finite number >= 0"),
        (["--drain-after", "-1"], "'-1': must be a finite number >= 0"),
        (["--timeout", "0"], "'0': must be a finite number > 0"),
        (["--timeout", "-1"], "'-1': must be a finite number > 0"),
        (["--timeout", "soon"], "'soon' is not a number of seconds"),
        (["--drain-after", "1", "--drain-pod", "nope"], "--drain-pod 'nope' is not a rank"),
        (["--drain-pod", "local-demo-rollout-0"], "needs --drain-at-refit N or --drain-after"),
        (["--drain-at-refit", "0"], "'0': must be a whole number of refits >= 1"),
        (["--drain-at-refit", "x"], "'x': must be a whole number of refits >= 1"),
        (["--drain-at-refit", "3"], "the job does 3 refit(s), so nothing would be left"),
        (["--drain-at-refit", "1", "--drain-after", "2"], "give one of them"),
        (["--drain-at-refit", "1", "--drain-pod", "nope"], "--drain-pod 'nope' is not a rank"),
        (["--kill-rollout-at-refit", "0"], "'0': must be a whole number of refits >= 1"),
        (["--kill-rollout-at-refit", "3"], "the job does 3 refit(s), so no refit would be left"),
        (["--kill-policy-at-refit", "-1"], "'-1': must be a whole number of refits >= 1"),
        (["--kill-policy-at-refit", "7"], "--kill-policy-at-refit 7: the job does 3 refit(s)"),
        (["--scale-rollout-at-refit", "3"], "'3': expected N:R"),
        (["--scale-rollout-at-refit", "1:x"], "'1:x': expected N:R"),
        (["--scale-rollout-at-refit", "0:3"], "the refit N must be >= 1"),
        (["--scale-rollout-at-refit", "1:0"], "R must be >= 1"),
        (["--scale-rollout-at-refit", "1:2"], "the job already has 2 rollout replica(s)"),
        (["--scale-rollout-at-refit", "3:1"], "the job does 3 refit(s)"),
        (["--scale-rollout-at-refit", "1:5000"], "over the 4096 a rendezvous holds"),
        (["--kill-rollout-at-refit", "1", "--drain-at-refit", "1"], "give one of them per run"),
    ],
)
def test_bad_flags_are_refused_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], expected: str
) -> None:
    err = _refused(["run", str(_local(tmp_path)), *flags], capsys)
    assert expected in err


def test_a_bad_drain_pod_lists_the_real_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(["run", str(_local(tmp_path)), "--drain-after", "1", "--drain-pod", "x"], capsys)
    assert "local-demo-policy-0" in err and "local-demo-rollout-1" in err


def test_suspended_job_is_refused_not_waited_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(["run", str(_local(tmp_path, suspend=True))], capsys)
    assert "spec.suspend is true" in err


def test_workdir_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = _refused(["run", str(_local(tmp_path)), "--workdir", str(blocker)], capsys)
    assert "exists and is not a directory" in err


def test_binary_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    err = _refused(["run", str(path)], capsys)
    assert "not a YAML manifest: byte" in err and "not UTF-8" in err


def test_wrong_kind_names_what_it_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: refit.dev/v1alpha1\nkind: RefitJobs\nmetadata: {name: x}\n")
    err = _refused(["run", str(path)], capsys)
    assert "found 0 (the file holds: RefitJobs; did you mean RefitJob, not RefitJobs?)" in err
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    assert "did you mean" not in _refused(["run", str(path)], capsys)


def test_numeric_name_says_it_must_be_a_string(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        "apiVersion: refit.dev/v1alpha1\nkind: RefitJob\nmetadata: {name: 12345}\n"
        "spec: {image: i}\n"
    )
    err = _refused(["run", str(path)], capsys)
    assert "metadata.name must be a string, got int 12345" in err


def test_bad_namespace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        "apiVersion: refit.dev/v1alpha1\nkind: RefitJob\n"
        "metadata: {name: x, namespace: 'Bad NS!'}\nspec: {image: i}\n"
    )
    err = _refused(["run", str(path)], capsys)
    assert "metadata.namespace 'Bad NS!' must be a DNS-1123 label" in err


def test_operator_without_credentials_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    err = _refused(["operator"], capsys)
    assert err.startswith("refit operator: cannot find the Kubernetes API")
    assert len(err.strip().splitlines()) == 1


def test_help_names_every_command_without_markup(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out
    for command in ("run", "operator", "crd"):
        assert f"    {command} " in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == "refit 0.1.0"


@pytest.mark.parametrize(
    ("rate", "shown"),
    [(5.4e9, "5.40 GB/s"), (3.2e6, "3.20 MB/s"), (4.5e3, "4.50 kB/s"), (12, "12 B/s")],
)
def test_small_rates_keep_their_digits(rate: float, shown: str) -> None:
    assert view.human_rate(rate) == shown


def test_live_lines_fit_a_narrow_terminal() -> None:
    lines = ["x" * 100, "short"]
    fitted = view.fit(lines, 40)
    assert [len(line) for line in fitted] == [39, 5]
    assert fitted[0].endswith("~")


def test_sweep_removes_only_dirs_of_dead_owners(tmp_path: Path) -> None:
    mine = workdir.create_own("job", tmp_path)  # owned by this live process
    dead = tmp_path / "refit-job-dead"
    dead.mkdir()
    (dead / workdir.OWNER_FILE).write_text("999999999 12345\n")  # no such pid
    recycled = tmp_path / "refit-job-recycled"
    recycled.mkdir()
    # This very pid, but another start time: the pid was reused, the owner is gone.
    (recycled / workdir.OWNER_FILE).write_text(f"{os.getpid()} 1\n")
    foreign = tmp_path / "refit-not-ours"
    foreign.mkdir()  # no marker: not made by refit run, never touched
    removed = workdir.sweep_stale(tmp_path)
    assert sorted(removed) == sorted([dead, recycled])
    assert mine.exists() and foreign.exists()
    assert not dead.exists() and not recycled.exists()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"weights": {"synthetic": {"hidden": 65536}}}, "more than this machine's"),
        ({"rollout": {"replicas": 100}}, "102 worker processes"),
    ],
)
def test_a_job_too_large_for_the_machine_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: dict[str, object], expected: str
) -> None:
    err = _refused(["run", str(_local(tmp_path, **spec))], capsys)
    assert expected in err and "--skip-resource-check" in err


def test_safetensors_needs_its_claim_mapped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _local(tmp_path, weights={"safetensors": {"claimName": "ckpt", "path": "m"}})
    err = _refused(["run", str(job)], capsys)
    assert "claimName 'ckpt': a local run has no PersistentVolumeClaims" in err
    assert "--claim ckpt=DIR" in err
    err = _refused(["run", str(job), "--claim", f"ckpt={tmp_path}"], capsys)
    assert f"no *.safetensors files in {tmp_path / 'm'}" in err
    err = _refused(["run", str(job), "--claim", f"ckpt={tmp_path / 'nope'}"], capsys)
    assert "not a directory" in err
    err = _refused(["run", str(job), "--claim", "ckpt"], capsys)
    assert "expected NAME=DIR" in err


def test_a_checkpoint_dtype_the_worker_cannot_move_is_refused_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The headers are read up front: no gang connects only to fail on ``uint16``."""
    import torch
    from safetensors.torch import save_file

    ckpt = tmp_path / "ckpt" / "m"
    ckpt.mkdir(parents=True)
    save_file({"ok": torch.zeros(4, dtype=torch.bfloat16)}, str(ckpt / "a.safetensors"))
    save_file({"ids": torch.zeros(3, dtype=torch.uint16)}, str(ckpt / "b.safetensors"))
    job = _local(tmp_path, weights={"safetensors": {"claimName": "ckpt", "path": "m"}})
    work = tmp_path / "work"
    argv = ["run", str(job), "--claim", f"ckpt={tmp_path / 'ckpt'}", "--workdir", str(work)]
    err = _refused(argv, capsys)
    assert f"tensor 'ids' has dtype U16 ({ckpt / 'b.safetensors'})" in err
    assert "BF16 (bfloat16)" in err and "U8 (uint8)" in err  # what is supported
    assert "'ok'" not in err
    assert not work.exists()


def test_a_file_that_is_not_safetensors_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "w.safetensors").write_bytes(b"\xff" * 4)
    job = _local(tmp_path, weights={"safetensors": {"claimName": "ckpt"}})
    err = _refused(["run", str(job), "--claim", f"ckpt={ckpt}"], capsys)
    assert f"{ckpt / 'w.safetensors'}: not a safetensors file (shorter than 8 bytes)" in err


def _with_template(tmp_path: Path, container: dict[str, object], **pod: object) -> Path:
    template = {"spec": {"containers": [{"name": "worker", **container}], **pod}}
    return _local(tmp_path, rollout={"replicas": 2, "template": template})


@pytest.mark.parametrize(
    ("container", "expected"),
    [
        (
            {"env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},
            "env[TOKEN]: valueFrom.secretKeyRef reads a Secret ('s', key 'k')",
        ),
        (
            {"env": [{"name": "C", "valueFrom": {"configMapKeyRef": {"name": "m", "key": "k"}}}]},
            "valueFrom.configMapKeyRef reads a ConfigMap ('m', key 'k')",
        ),
        ({"envFrom": [{"secretRef": {"name": "creds"}}]}, "envFrom: secretRef reads a Secret"),
    ],
)
def test_an_env_from_the_api_is_refused_with_what_to_use_instead(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], container: dict[str, object], expected: str
) -> None:
    work = tmp_path / "work"
    job = _with_template(tmp_path, container)
    err = _refused(["run", str(job), "--workdir", str(work)], capsys)
    assert "spec.rollout.template.spec.containers[worker]." in err and expected in err
    assert "give the value inline" in err
    assert not work.exists()


def test_the_ignored_line_names_cluster_only_settings_and_why() -> None:
    from refit_operator.local.ignored import ignored_line

    raw = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())["spec"]
    assert ignored_line(raw) == (
        "refit run: ignored on one machine: image (no image pulls: workers run from this "
        "Python environment)"
    )
    raw["ttlSecondsAfterFinished"] = 60
    raw["policy"]["template"] = {
        "metadata": {"labels": {"team": "rl"}},
        "spec": {
            "containers": [{"name": "worker"}],
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "imagePullSecrets": [{"name": "reg"}],
        },
    }
    line = ignored_line(raw)
    assert "image, policy.template.spec.imagePullSecrets (no image pulls" in line
    assert "policy.template.spec.nodeSelector, policy.template.spec.tolerations (one node" in line
    assert "ttlSecondsAfterFinished (the run ends with the job" in line
    assert "policy.template.metadata.labels (no API server" in line


def _status(**fields: object) -> RefitJobStatus:
    return RefitJobStatus.model_validate(fields)


def test_connected_speaks_of_the_current_epoch_only() -> None:
    t0, t1 = datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 1, 0, 1, tzinfo=UTC)

    def was(at: datetime) -> list[dict[str, object]]:
        return [{"type": "Connected", "status": "True", "reason": "Open", "lastTransitionTime": at}]

    # Epoch 0's gang connected; the gang was stopped and epoch 1 is being brought up.
    restarting = _status(phase="Restarting", epoch=1, conditions=was(t0))
    assert view.connection(restarting) == "-"
    recreated = _status(phase="Running", epoch=1, epoch_start_time=t1, conditions=was(t0))
    assert view.connection(recreated) == "connecting"
    connected = _status(phase="Running", epoch=1, epoch_start_time=t0, conditions=was(t1))
    assert view.connection(connected) == "connected"
    spec = parse_spec({"image": "i", "transfer": {"refits": 3}})
    assert "connected=no" in view.status_line("j", spec, recreated, 1.0)
    assert "connected=yes" in view.status_line("j", spec, connected, 1.0)


def test_the_line_and_the_live_view_show_the_status_bytes() -> None:
    """One figure: what the rollout pods reported receiving (issue #30: the live view
    once showed 36 MiB beside a total of 27 MiB)."""
    spec = parse_spec({"image": "i", "transfer": {"refits": 3}})
    status = _status(phase="Running", refits_completed=1, bytes_transferred=27 << 20)
    assert "refits=1/3 bytes=28311552 " in view.status_line("j", spec, status, 1.0)
    live = "\n".join(view.live_lines("j", spec, status, 1.0))
    assert "committed 1  moved 27.0 MiB  last" in live


def test_an_interrupt_after_every_refit_committed_says_so() -> None:
    spec = parse_spec({"image": "i", "transfer": {"refits": 3}})
    done = RunResult(_status(phase="Running", refits_completed=3), interrupted=True)
    assert view.summary("j", spec, done, 9.0)[0] == (
        "RefitJob j: interrupted after all 3 refit(s) committed, before the job was marked "
        "Succeeded in 9.0s"
    )
    half = RunResult(_status(phase="Running", refits_completed=2), interrupted=True)
    assert view.summary("j", spec, half, 9.0)[0] == "RefitJob j: interrupted in 9.0s"


def test_relative_script_paths_are_read_from_the_manifests_directory(tmp_path: Path) -> None:
    from refit_operator.local.paths import resolve

    (tmp_path / "train.py").write_text("")
    raw = {
        "policy": {"command": ["python", "train.py"], "args": ["--lr", "0.1"]},
        "rollout": {"command": ["/usr/bin/python3", "missing.py"]},
    }
    local, notes = resolve(raw, tmp_path)
    assert local["policy"]["command"] == ["python", str(tmp_path / "train.py")]
    assert local["policy"]["args"] == ["--lr", "0.1"] and local["rollout"] == raw["rollout"]
    assert notes == [f"policy.command: train.py -> {tmp_path / 'train.py'}"]
    assert raw["policy"]["command"] == ["python", "train.py"]  # the manifest is not changed


@pytest.mark.parametrize(
    ("drained", "phase", "replacements", "note"),
    [
        ("j-rollout-0-g0", "Succeeded", 0, "after it had committed every refit"),
        ("j-rollout-0-g0", "Succeeded", 1, None),  # replaced: the drain did its part
        ("j-rollout-0-g0", "Failed", 0, None),  # the failure says what happened
        ("j-policy-0-e0", "Succeeded", 0, None),  # a policy drain is a new epoch instead
        (None, "Succeeded", 0, "nothing was drained"),
    ],
)
def test_a_drain_that_changed_nothing_says_so(
    drained: str | None, phase: str, replacements: int, note: str | None
) -> None:
    from refit_operator.local.command import _undrained_note

    status = _status(phase=phase, refits_completed=3, rollout={"replacements": replacements})
    args = argparse.Namespace(drain_at_refit=1, drain_after=None)
    said = _undrained_note(args, RunResult(status, drained=drained))
    if note is None:
        assert said is None
    else:
        assert said is not None and note in said, said
