"""``refit run`` as a user runs it: a subprocess on a manifest, real worker processes, real
NIXL, real signals, the file-backed rendezvous.  Nothing is emulated.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.support.bad_manifests import BAD_SPECS, ISSUE_50_FILES, manifest_text
from tests.support.fault_runs import sent_refits
from tests.support.processes import processes_under
from tests.support.versions import job_key, trainer_digest

from refit_operator.api.models import parse_spec
from refit_operator.local.command import _available_memory as available_memory
from refit_worker.contract.bounds import MAX_BUCKET_BYTES
from refit_worker.contract.shards import shard_of_key, shards_needed
from refit_worker.pod.weights import synthetic_state_dict

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "worker")]),
    "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
}


def _manifest(tmp_path: Path, **spec_overrides: object) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())
    doc["metadata"]["name"] = "e2e-run"
    # Back to back unless a test sets a pace: the example's one-second steps are there
    # for its drain demo, and would add seconds to every test built on it.
    doc["spec"]["weights"]["synthetic"].pop("pace", None)
    for dotted, value in spec_overrides.items():
        node = doc["spec"]
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _run(
    args: list[str], timeout: float = 240, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "refit_operator.cli", "run", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=cwd,
    )


def _start(args: list[str], **popen: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "refit_operator.cli", "run", *args],
        text=True,
        **{"env": ENV, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, **popen},
    )


def _wait_for_gang(proc: subprocess.Popen[str], under: Path, ranks: int = 4) -> list[int]:
    deadline = time.monotonic() + 120
    while len(processes_under(under)) < ranks:
        assert time.monotonic() < deadline, "the gang never started"
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.2)
    return processes_under(under)


def _all_gone(pids: list[int], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_success_with_verification(tmp_path: Path) -> None:
    # A relative --workdir: pods run in directories of their own, so it must be resolved.
    workdir = tmp_path / "work"
    manifest = _manifest(tmp_path, **{"transfer.refits": 2})
    done = _run([str(manifest), "--workdir", "work"], cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "phase=Succeeded" in out
    assert "refits 2/2" in out and "preemptions 0" in out
    assert "verification: bit-exact" in out
    assert not processes_under(workdir)


def test_a_drained_rollout_pod_is_replaced_alone_and_the_job_completes(tmp_path: Path) -> None:
    path = _manifest(tmp_path, **{"transfer.refits": 2})
    done = _run([str(path), "--drain-after", "1", "--plain"])
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "reason=Drain draining e2e-run-rollout-0-g0" in out
    # Its own failure domain: the next generation replaces it, the policy gang stays.
    assert "reason=RolloutReplaced rollout rank 0 replaced by e2e-run-rollout-0-g1" in out
    assert "epoch=1" not in out
    assert "preemptions 0  rollout replacements 1 (drained e2e-run-rollout-0-g0)" in out
    assert "restarts 0" in out
    assert "verification: bit-exact" in out


def test_drain_at_refit_replaces_the_rollout_replica_without_a_new_epoch(tmp_path: Path) -> None:
    """The README's drain command: the drain lands once a refit is committed; the drained
    rollout replica is replaced alone, so every refit is committed in epoch 0; the bytes
    add up across the drained pod and its replacement."""
    status = tmp_path / "job.json"
    args = ["--drain-at-refit", "1", "--plain", "--status-file", str(status)]
    done = _run([str(ROOT / "examples" / "local.yaml"), *args])
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    _one_byte_figure(out, status)
    assert "reason=Drain draining local-demo-rollout-0-g0" in out
    assert "rollout replacements 1 (drained local-demo-rollout-0-g0)" in out
    assert "preemptions 0" in out and "refits 3/3" in out
    epochs = [int(row.split()[1]) for row in out.splitlines() if re.match(r"\s+\d+\s+\d+\s", row)]
    assert epochs and set(epochs) == {0}, out


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_every_process(tmp_path: Path, signum: int, code: int) -> None:
    workdir = tmp_path / "work"
    manifest = _manifest(tmp_path, **{"transfer.refits": 100_000})
    proc = _start([str(manifest), "--workdir", str(workdir)])
    try:
        workers = _wait_for_gang(proc, workdir)
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, out
    name = signal.Signals(signum).name
    assert f"stopped by {name}; every worker was stopped" in out
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not processes_under(workdir)
    assert not list((workdir / "pods").iterdir())  # no pod's files left behind


def test_kill_9_takes_the_workers_along_and_the_next_run_sweeps(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    manifest = _manifest(tmp_path, **{"transfer.refits": 100_000})
    proc = _start([str(manifest)], env={**ENV, "TMPDIR": str(tmp)})
    try:
        workers = _wait_for_gang(proc, tmp)
        proc.kill()  # SIGKILL: no handler, no clean-up of its own
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _all_gone(workers, within=10), "workers outlived their refit run"
    (left,) = list(tmp.glob("refit-e2e-run-*"))
    # The next run finds the directory of a run that is gone, and removes it.
    short = _manifest(tmp_path, **{"transfer.refits": 1})
    done = subprocess.run(
        [sys.executable, "-m", "refit_operator.cli", "run", "--plain", str(short)],
        env={**ENV, "TMPDIR": str(tmp)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"removed {left}, left by an earlier run that was killed" in done.stdout
    assert not list(tmp.iterdir())  # neither the old directory nor the new run's


def test_closed_output_pipe_stops_the_run_quietly(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    manifest = _manifest(tmp_path, **{"transfer.refits": 100_000})
    proc = _start([str(manifest), "--plain", "--workdir", str(workdir)], stderr=subprocess.PIPE)
    try:
        workers = _wait_for_gang(proc, workdir)
        assert proc.stdout is not None
        proc.stdout.close()  # as `refit run ... | head -3` does once it has its lines
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGPIPE, err
    assert "Traceback" not in err and "BrokenPipeError" not in err
    assert _all_gone(workers, within=5)
    assert not processes_under(workdir)


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


_ISSUE_50 = {
    **{
        row: (manifest_text(spec), words)
        for row, spec, words in BAD_SPECS
        if row in ("bucket size 1Ti", "bucket size 1", "timeout 1e308", "synthetic layers 1e12")
    },
    # The same values as a user types them (``1e308``, not YAML 1.1's ``1.0e+308``).
    **{row: (text, words) for row, text, words in ISSUE_50_FILES},
}


@pytest.mark.parametrize("row", _ISSUE_50)
def test_issue_50_bad_inputs_exit_2_naming_the_field_before_any_worker(
    tmp_path: Path, row: str
) -> None:
    """Each once passed ``refit run``'s checks and failed (or hung) in the pods."""
    text, words = _ISSUE_50[row]
    path = tmp_path / "job.yaml"
    path.write_text(text)
    workdir = tmp_path / "work"
    done = _run([str(path), "--workdir", str(workdir)], timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"refit run: {path}: invalid spec: ")
    assert all(word in done.stderr for word in words), done.stderr
    # Nothing started: no opening line, no working directory, no file beside the manifest.
    assert done.stdout == ""
    assert not workdir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


def test_buckets_this_machine_cannot_allocate_are_refused_before_any_worker(
    tmp_path: Path,
) -> None:
    """The largest bucket the API allows, on more rollout ranks than this machine has
    memory for (two buckets each, allocated in full): refused by the sizing, naming the
    field, with nothing started."""
    ranks = available_memory() // (2 * MAX_BUCKET_BYTES) + 1
    path = _manifest(tmp_path, **{"transfer.bucketSize": "64Gi", "rollout.replicas": ranks})
    workdir = tmp_path / "work"
    done = _run([str(path), "--workdir", str(workdir)], timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "spec.transfer.bucketSize: each rank allocates 2 buckets of 64.0 GiB" in done.stderr
    assert done.stdout == "" and not workdir.exists()


def test_safetensors_from_a_mapped_claim(tmp_path: Path) -> None:
    """A checkpoint on a 'claim' served from a local directory, with integer tensors."""
    import torch
    from safetensors.torch import save_file

    ckpt = tmp_path / "volume" / "step-100"
    ckpt.mkdir(parents=True)
    save_file(
        {"w": torch.randn(64, 64), "positions": torch.arange(128, dtype=torch.int64)},
        str(ckpt / "model.safetensors"),
    )
    path = _manifest(tmp_path, **{"transfer.refits": 2})
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["weights"] = {"safetensors": {"claimName": "ckpt", "path": "step-100"}}
    path.write_text(yaml.safe_dump(doc))
    done = _run([str(path), "--plain", "--claim", f"ckpt={tmp_path / 'volume'}"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "phase=Succeeded" in done.stdout
    assert "refits 2/2" in done.stdout


def _rows_and_total(out: str) -> tuple[list[int], int]:
    """Bytes of each per-refit row of the summary, and the summary's bytes line."""
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    rows, total = [], None
    for line in out.splitlines():
        words = line.split()
        if len(words) >= 5 and words[1].isdigit() and words[3] in units:
            rows.append(round(float(words[2]) * units[words[3]]))
        if line.strip().startswith("refits ") and " bytes " in line:
            number, unit = line.split(" bytes ")[1].split()[:2]
            total = round(float(number) * units[unit])
    assert total is not None, out
    return rows, total


def _one_byte_figure(out: str, status_file: Path) -> int:
    """Issue #30: the summary's rows, its total line, the plain lines' ``bytes=`` and the
    final status (``--status-file``) say the same number; the live figure never goes down.
    The summary prints MiB to one decimal: it agrees within that rounding."""
    rows, total = _rows_and_total(out)
    live = [int(n) for n in re.findall(r" bytes=(\d+) ", out)]
    status = json.loads(status_file.read_text())["status"]
    counted = sum(pod["bytes"] for pod in status["bytesCounted"])
    assert live and live == sorted(live), out
    assert status["bytesTransferred"] == live[-1] == counted > 0, (status, out)
    rounding = 0.05 * (1 << 20)
    assert abs(total - counted) <= rounding, out
    assert rows and abs(sum(rows) - counted) <= rounding * len(rows), out
    return counted


@pytest.mark.parametrize("run", range(2))
def test_summary_rows_add_up_to_the_total(tmp_path: Path, run: int) -> None:
    done = _run([str(ROOT / "examples" / "local.yaml"), "--plain"], cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows, total = _rows_and_total(done.stdout)
    assert rows and sum(rows) == total, done.stdout
    assert "verification: bit-exact" in done.stdout


def test_pods_that_do_nothing_do_not_succeed(tmp_path: Path) -> None:
    """``command: [/bin/true]`` exits 0 everywhere and moves nothing."""
    path = _manifest(
        tmp_path,
        **{
            "policy.command": ["/bin/true"],
            "rollout.command": ["/bin/true"],
            "failurePolicy.maxRestarts": 0,
        },
    )
    done = _run([str(path), "--plain"], timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "Failed" in out and "Succeeded" not in out
    assert "reported 0 of 3 refits committed" in out
    assert "refits 0/3" in out
    assert "verification: nothing committed, nothing verified" in out
    assert "bit-exact" not in out


def test_a_failing_worker_says_why(tmp_path: Path) -> None:
    """A Python exception in a worker reaches the job's status and the summary."""
    path = _manifest(
        tmp_path,
        **{
            "policy.command": [sys.executable, "-c", "raise ValueError('trainer exploded')"],
            "failurePolicy.maxRestarts": 0,
        },
    )
    done = _run([str(path), "--plain"], timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "message: " in out and "ValueError: trainer exploded" in out.split("message: ")[1]
    assert "last lines of e2e-run-policy-0-e0's log:" in out
    assert "| ValueError: trainer exploded" in out


def test_the_worker_writes_its_own_reason(tmp_path: Path) -> None:
    """refit-worker's termination message: its exception, not a log line.  An unknown
    backend is a failure no restart can cure: exit 84, and the job fails at once even
    with restarts left."""
    path = _manifest(tmp_path, **{"transfer.backend": "BOGUS", "failurePolicy.maxRestarts": 2})
    done = _run([str(path), "--plain"], timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    message = done.stdout.split("message: ")[1].splitlines()[0]
    assert "failed: exit code 84: " in message and "BOGUS" in message, message
    assert "not retryable" in message and "restarts 0" in done.stdout, done.stdout


USER_CODE = r"""
import asyncio, sys
import torch
from refit_worker import Preempted, RefitSession

async def main() -> None:
    with RefitSession.from_env() as session:
        role = session.config.role
        weights = {"w": torch.zeros(256, 1024), "b": torch.zeros(1024)}
        for refit in session.pending_refits:
            if role == "policy":
                for t in weights.values():
                    t.fill_(refit + 1)
                await session.send(weights.items(), refit_id=refit)
            else:
                await session.receive_into(weights, refit_id=refit, mode="double_buffer")
                assert float(weights["w"][0, 0]) == refit + 1

try:
    asyncio.run(main())
except Preempted:
    sys.exit(83)
"""


def test_a_users_own_session_code_fills_the_status(tmp_path: Path) -> None:
    """A trainer and a server of the user's own, built on RefitSession: the job's status
    and the table come from the session's own reports."""
    script = tmp_path / "user_code.py"
    script.write_text(USER_CODE)
    command = [sys.executable, str(script)]
    path = _manifest(tmp_path, **{"policy.command": command, "rollout.command": command})
    status = tmp_path / "job.json"
    done = _run([str(path), "--plain", "--status-file", str(status)])
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "phase=Succeeded" in out and "refits 3/3" in out
    rows, total = _rows_and_total(out)  # as printed: MiB to one decimal
    assert len(rows) == 3 and sum(rows) == total
    # Exactly what the policy sent: 2 rollout ranks x 3 refits x (256*1024 + 1024) float32
    # values, less a refit a rank that started late took from its peer instead (issue #31).
    replicas = json.loads(status.read_text())["status"]["rolloutReplicas"]
    seeded = sum(r["seededFrom"] != "policy" for r in replicas)
    assert f"bytes={(2 * 3 - seeded) * (256 * 1024 + 1024) * 4} " in out
    assert "verification: checksums" in out


def test_each_rank_serves_metrics_on_its_own_port(tmp_path: Path) -> None:
    """One host, one network namespace: ``metrics.port`` counts up, one port per rank, and
    the run says which; every rank's log shows it bound its port (none "cannot serve")."""
    workdir = tmp_path / "work"
    manifest = _manifest(tmp_path, **{"transfer.refits": 1, "metrics": {"port": 19400}})
    done = _run([str(manifest), "--workdir", str(workdir), "--plain"])
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if "metrics at" in x)
    ports = dict(
        (pod, int(port.lstrip(":")))
        for pod, port in (item.split() for item in line.split("per rank: ")[1].split(", "))
    )
    assert sorted(ports) == [f"e2e-run-{r}-{i}" for r in ("policy", "rollout") for i in (0, 1)]
    assert len(set(ports.values())) == 4 and min(ports.values()) >= 19400
    logs = {p.name: p.read_text() for p in (workdir / "logs").glob("*.log")}
    for pod, port in ports.items():
        (text,) = [t for name, t in logs.items() if name.startswith(pod + "-")]
        assert f"metrics on 0.0.0.0:{port}/metrics" in text, text[-2000:]
        assert "cannot serve metrics" not in text


def test_the_session_example_runs_as_a_job(tmp_path: Path) -> None:
    """examples/session_job.py (the README's RefitSession example) as the policy and
    rollout commands of examples/session.yaml: real processes, real NIXL, its own reports."""
    done = _run([str(ROOT / "examples" / "session.yaml"), "--plain"], cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert f"policy.command: session_job.py -> {ROOT / 'examples' / 'session_job.py'}" in out
    assert "phase=Succeeded" in out and "refits 3/3" in out
    # Two rollout ranks, each receiving the model's 2 x 256 x 512 + 512 + 256 float32 values.
    assert f"bytes={3 * 2 * (2 * 256 * 512 + 512 + 256) * 4} " in out
    assert "verification: checksums" in out


def test_the_session_example_outside_a_pod_says_where_it_runs() -> None:
    env = {k: v for k, v in ENV.items() if not k.startswith("REFIT_")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "session_job.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "runs inside a RefitJob pod" in done.stderr and "spec.policy.command" in done.stderr


def test_kill_rollout_at_refit_replaces_that_replica_alone(tmp_path: Path) -> None:
    """Issue #20: a SIGKILLed rollout pod is replaced alone; the policy pods run on, the
    replacement joins at a refit boundary and checks what it commits bit for bit."""
    path = _manifest(tmp_path, **{"transfer.refits": 6})
    status, work = tmp_path / "job.json", tmp_path / "work"
    args = ["--kill-rollout-at-refit", "2", "--plain", "--status-file", str(status)]
    done = _run([str(path), *args, "--workdir", str(work)], timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # The killed pod's bytes stay counted beside its replacement's: each rollout pod's
    # count is every refit its log says the policy sent it.  Not a count of pods: a pod may
    # get nothing from the policy (seeded by its peer, issue #31, or killed before its
    # first commit); once on a loaded machine the status counted two.  The killed pod's
    # log may be one refit short: its rank reports a commit, then logs it, and the SIGKILL
    # can land between the two (met beside a busy core: reported 1, logged 0).
    logs = {p.name: p.read_text() for p in (work / "logs").glob("e2e-run-rollout-*.log")}
    assert len(logs) == 3, out
    final = json.loads(status.read_text())["status"]
    model = final["rolloutReplicas"][0]["seededBytes"]  # any refit's bytes
    counted = {row["uid"][:8]: row["bytes"] for row in final["bytesCounted"]}
    assert _one_byte_figure(out, status) == sum(counted.values()), out
    killed = re.search(r"e2e-run-rollout-0-g0-(\w{8})\.log", " ".join(logs))
    assert killed is not None, sorted(logs)
    for name, text in logs.items():
        uid = name.removesuffix(".log")[-8:]
        logged = len(sent_refits(text)) * model
        allowed = (logged, logged + model) if uid == killed.group(1) else (logged,)
        assert counted.get(uid, 0) in allowed, (name, counted, logged, out)
    assert re.search(r"reason=Fault SIGKILL rollout pod e2e-run-rollout-0\S* at refit 2", out)
    assert "the policy pods ran on untouched (same 2 uid(s))" in out, out
    assert re.search(r"its replacement committed its first refit [\d.]+ s after the kill", out)
    assert "refits 6/6" in out and "restarts 0" in out and "replacements 1" in out, out
    assert "gen0=1" in out, out  # the per-replica status: rank 0 is on its second pod
    assert "verification: bit-exact" in out


def test_kill_policy_at_refit_restarts_the_policy_gang_only(tmp_path: Path) -> None:
    path = _manifest(tmp_path, **{"transfer.refits": 6})
    status = tmp_path / "job.json"
    args = ["--kill-policy-at-refit", "2", "--plain", "--status-file", str(status)]
    done = _run([str(path), *args], timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # The rollout pods outlived the policy restart: two pods, each counted once.
    assert len(json.loads(status.read_text())["status"]["bytesCounted"]) == 2, out
    _one_byte_figure(out, status)
    assert re.search(r"reason=Fault SIGKILL policy pod e2e-run-policy-0\S* at refit 2", out)
    assert "the rollout pods ran on untouched (same 2 uid(s))" in out, out
    assert "refits 6/6" in out and "restarts 1" in out and "replacements 0" in out, out
    assert "verification: bit-exact" in out


@pytest.mark.parametrize("replicas", [3, 1])
def test_scale_rollout_at_refit_leaves_the_policy_pods(tmp_path: Path, replicas: int) -> None:
    path = _manifest(tmp_path, **{"transfer.refits": 6})
    status = tmp_path / "job.json"
    args = ["--scale-rollout-at-refit", f"1:{replicas}", "--plain", "--status-file", str(status)]
    done = _run([str(path), *args], timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    job = json.loads(status.read_text())
    assert job["spec"]["rollout"]["replicas"] == replicas, job["spec"]
    # Every pod the job had stays counted: a scale-down's left pod too.
    assert len(job["status"]["bytesCounted"]) == max(replicas, 2), out
    _one_byte_figure(out, status)
    assert f"reason=Fault scaling e2e-run: spec.rollout.replicas -> {replicas} at refit 1" in out
    assert f"scaled to {replicas} rollout replica(s) at refit 1" in out
    assert "the policy pods ran on untouched (same 2 uid(s))" in out, out
    assert f"rollout_ready={replicas}/{replicas}" in out, out
    assert "refits 6/6" in out and "restarts 0" in out and "preemptions 0" in out, out
    assert "verification: bit-exact" in out


def test_a_killed_rollout_replica_is_seeded_by_its_peers_not_the_policy(tmp_path: Path) -> None:
    """Issue #31: with 1 policy and 3 rollout ranks, the replacement of a SIGKILLed
    rollout pod takes the last committed refit from its live peers over NIXL (mid-job,
    or from peers that stay after the last refit), checked bit for bit; the policy sends
    it only the refits after that one, and never sends any refit again."""
    refits = 6
    path = _manifest(
        tmp_path,
        **{
            "policy.replicas": 1,
            "rollout.replicas": 3,
            "transfer.refits": refits,
            "weights.synthetic.pace": 0.5,
        },
    )
    status, work = tmp_path / "job.json", tmp_path / "work"
    args = ["--kill-rollout-at-refit", "3", "--plain", "--status-file", str(status)]
    done = _run([str(path), *args, "--workdir", str(work)], timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "refits 6/6" in out and "restarts 0" in out and "replacements 1" in out, out
    assert "verification: bit-exact" in out
    replica = json.loads(status.read_text())["status"]["rolloutReplicas"][0]
    assert replica["generation"] == 1, replica
    assert replica["seededFrom"] in ("rollout-1", "rollout-2"), replica
    seeded, model_bytes = replica["seededRefit"], replica["seededBytes"]
    assert 2 <= seeded < refits and replica["secondsToServing"] > 0, replica
    assert re.search(
        rf"reason=ReplicaSeeded rollout-0 \(pod e2e-run-rollout-0-g1\) seeded from "
        rf"{replica['seededFrom']}: refit {seeded}, ",
        out,
    ), out
    assert re.search(r"its replacement committed its first refit .* \(seeded from rollout-", out)
    # What the replacement got from the policy: exactly the refits after the seeded one.
    report = json.loads(_entry_file(work, "progress.rollout.0", 1, 3).read_text())
    assert [r["refit"] for r in report["recent"]] == list(range(seeded + 1, refits)), report
    assert report["bytes_total"] == (refits - seeded - 1) * model_bytes, report
    policy_log = "".join(p.read_text() for p in (work / "logs").glob("e2e-run-policy-*.log"))
    assert "again" not in policy_log, policy_log
    # Issue #32: every replica, the seeded replacement too, serves the last refit, and its
    # digest is the trainer's state's, regenerated here: the bytes served, not a label.
    digest = trainer_digest(yaml.safe_load(path.read_text())["spec"], refits - 1)
    versions = json.loads(status.read_text())["status"]["versions"]
    # Issue #50: each of them, the seeded one too, checked the job's key's seals of it.
    key = job_key([out])
    assert versions == [
        {"refit": refits - 1, "digest": digest, "replicas": [0, 1, 2], "signedBy": key}
    ], versions
    assert (
        f"serving: refit {refits - 1} {digest} signed {key} served by rollout-0, rollout-1, "
        "rollout-2" in out
    )


def _entry_file(work: Path, key: str, policy: int, rollout: int) -> Path:
    """Where ``refit run``'s file store keeps rendezvous entry ``key`` (its role's map)."""
    shard = shard_of_key(key, policy, rollout, shards_needed(policy, rollout))
    return work / "rendezvous" / f"shard-{shard}" / key


def _logged_at(text: str, needle: str) -> str:
    """The timestamp (``YYYY-MM-DD HH:MM:SS,mmm``, sortable) of the line holding ``needle``."""
    line = next((ln for ln in text.splitlines() if needle in ln), None)
    assert line is not None, f"no line with {needle!r} in:\n{text}"
    return line[:23]


def test_a_drained_rollout_replica_hands_over_to_its_replacement(tmp_path: Path) -> None:
    """Issue #31: with one rollout replica, a drain of its pod does not leave the job
    without weights served for a trainer's step: the drained pod stays (within its grace
    period) until its replacement, created at once, has seeded the last committed refit
    from it; only then does it exit, saying nothing under the rank's progress key."""
    path = _manifest(
        tmp_path,
        **{"rollout.replicas": 1, "transfer.refits": 6, "weights.synthetic.pace": 0.5},
    )
    status, work = tmp_path / "job.json", tmp_path / "work"
    args = ["--drain-at-refit", "2", "--plain", "--status-file", str(status)]
    done = _run([str(path), *args, "--workdir", str(work)], timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "refits 6/6" in out and "restarts 0" in out and "verification: bit-exact" in out, out
    replica = json.loads(status.read_text())["status"]["rolloutReplicas"][0]
    assert replica["generation"] == 1 and replica["seededFrom"] == "rollout-0-g0", replica
    logs = work / "logs"
    old = next(logs.glob("e2e-run-rollout-0-g0-*.log")).read_text()
    new = next(logs.glob("e2e-run-rollout-0-g1-*.log")).read_text()
    seeded = _logged_at(new, f"seeded refit {replica['seededRefit']} from rollout-0-g0")
    handed = _logged_at(old, "handed over to pod")
    exited = _logged_at(old, "exiting with code 83")
    # The replacement served before the drained pod went.
    assert seeded < handed <= exited, (seeded, handed, exited)


DELTA_REFITS = 21
DELTA_SENT = re.compile(r"refit (\d+) as a delta onto refit (\d+)")
DELTA_APPLIED = re.compile(r"refit applied as a delta onto refit (\d+)")


def test_deltas_in_a_row_end_bit_exact_and_a_replacement_gets_a_whole_version_first(
    tmp_path: Path,
) -> None:
    """Issue #32: an MoE-shaped model of which a training step changes 1% of the
    elements, ``transfer.delta: on``, 1 policy and 2 rollout ranks, rollout-0 SIGKILLed at
    refit 5: the replica never killed applies 20 deltas in a row, each checked whole before
    it commits and bit for bit against regenerated weights; the replacement starts from a
    whole version (a peer's seed, or the policy's whole refit after it declined a delta it
    had no base for) and then takes deltas too."""
    path = _manifest(
        tmp_path,
        **{
            "policy.replicas": 1,
            "rollout.replicas": 2,
            "transfer.refits": DELTA_REFITS,
            "transfer.delta": "on",
            "weights.synthetic.changes": 0.01,
            "weights.synthetic.experts": 2,
            # The trainer waits for the replacement to serve before its next step, so the
            # replacement takes deltas however long its start takes (not a race with pace).
            "weights.synthetic.lockstep": True,
        },
    )
    status, work = tmp_path / "job.json", tmp_path / "work"
    args = ["--kill-rollout-at-refit", "5", "--plain", "--status-file", str(status)]
    done = _run([str(path), *args, "--workdir", str(work)], timeout=420)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert f"refits {DELTA_REFITS}/{DELTA_REFITS}" in out and "replacements 1" in out, out
    assert "verification: bit-exact" in out, out
    logs = work / "logs"
    policy = "".join(p.read_text() for p in logs.glob("e2e-run-policy-*.log"))
    # Every refit after the first went out as a delta onto the one before it.
    sent = {int(m.group(1)): int(m.group(2)) for m in DELTA_SENT.finditer(policy)}
    assert sent == {k: k - 1 for k in range(1, DELTA_REFITS)}, policy[-3000:]
    # The replica never killed applied all 20, each checked before it committed.
    (kept,) = logs.glob("e2e-run-rollout-1-g0-*.log")
    applied = [int(m.group(1)) for m in DELTA_APPLIED.finditer(kept.read_text())]
    assert applied == list(range(DELTA_REFITS - 1)), applied
    # The replacement: first a whole version (never a delta onto nothing), then deltas.
    (late,) = logs.glob("e2e-run-rollout-0-g1-*.log")
    text = late.read_text()
    commits = [int(m.group(1)) for m in re.finditer(r"refit (\d+) committed", text)]
    assert commits, text
    # Each later refit came as a delta onto the one before, unless it joined that refit
    # after its first round (the policy's later rounds, to members that lack it, are
    # whole): which one is the order of its start and the policy's send, not a guess.
    onto = [int(m.group(1)) for m in DELTA_APPLIED.finditer(text)]
    resent = {int(m.group(1)) for m in re.finditer(r"sending refit (\d+) again to \[0", policy)}
    assert onto and min(onto) >= commits[0], text
    for refit in commits[1:]:
        assert (refit - 1 in onto) != (refit in resent), (refit, onto, sorted(resent))
    # What crossed: the first refit whole, then deltas of ~1% of the elements.
    report = json.loads(_entry_file(work, "progress.rollout.1", 1, 2).read_text())
    spec = yaml.safe_load(path.read_text())["spec"]
    whole = _model_bytes(spec)
    assert whole < report["bytes_total"] < 2 * whole, (report["bytes_total"], whole)
    # The ledger names the trainer's state, regenerated here, on both replicas.
    digest = trainer_digest(spec, DELTA_REFITS - 1)
    versions = json.loads(status.read_text())["status"]["versions"]
    key = job_key([done.stdout])
    assert versions == [
        {"refit": DELTA_REFITS - 1, "digest": digest, "replicas": [0, 1], "signedBy": key}
    ], versions


def _model_bytes(spec: dict[str, Any]) -> int:
    weights = parse_spec(spec).weights.synthetic
    assert weights is not None, "a synthetic-weights job"
    return sum(t.numel() * t.element_size() for t in synthetic_state_dict(weights).values())
