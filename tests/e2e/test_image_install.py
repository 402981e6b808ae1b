"""The container image's install steps, replayed without a Docker engine.

The Dockerfile does all its installing through ``docker/install.sh``; here the same script
runs, step by step, on a copy of exactly the build context that ``.dockerignore`` lets
through, into a fresh virtual environment (no system site-packages), and the installed
console scripts must start.

Real: the script, pip, a fresh venv, the installed entrypoints run as processes.  Not the
same as in the image: no Docker engine builds it, and ``TORCH_INDEX_URL`` is set empty so
torch comes from this machine's pip configuration instead of the PyTorch index.  Under
``.ci/run`` that configuration is the run's wheelhouse (``REFIT_TEST_WHEELHOUSE``, from
``.ci/wheelhouse.sh``: the same pinned wheels, no registry asked), so the replay does not
download torch a second time in one run; without it, pip asks the registry.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "docker/install.sh"
ENTRYPOINTS = ("refit", "refit-worker", "refit-signal")
INSTALL_TIMEOUT_S = 900.0
QUICK_TIMEOUT_S = 60.0


def allow_list(dockerignore: str) -> list[str]:
    """The paths an allow-list ``.dockerignore`` (``*`` then ``!path`` lines) lets through."""
    lines = [ln.strip() for ln in dockerignore.splitlines()]
    rules = [ln for ln in lines if ln and not ln.startswith("#")]
    if not rules or rules[0] != "*":
        raise ValueError(f".dockerignore must start with '*' (an allow-list), got {rules[:1]}")
    allowed = []
    for rule in rules[1:]:
        if rule.startswith("!"):
            allowed.append(rule[1:].rstrip("/"))
        elif not rule.startswith("**/"):
            raise ValueError(f".dockerignore rule {rule!r} is neither '!path' nor '**/pattern'")
    return allowed


def copy_context(dest: Path) -> Path:
    """Copy what the Docker build context would hold into ``dest``."""
    for rel in allow_list((REPO / ".dockerignore").read_text()):
        source = REPO / rel
        if source.is_dir():
            shutil.copytree(
                source, dest / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / rel)
    return dest


def _clean_env(**extra: str) -> dict[str, str]:
    # Nothing of this checkout's environment may leak into the fresh venv.
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH"}}
    wheelhouse = os.environ.get("REFIT_TEST_WHEELHOUSE")
    if wheelhouse:
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=wheelhouse)
    env.update(extra)
    return env


def run_script(
    step: str, venv: Path, src: Path, timeout: float, **env: str
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            ["sh", str(src / SCRIPT), step, str(venv), str(src)],
            capture_output=True,
            text=True,
            cwd=src,
            env=_clean_env(**env),
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError(f"install.sh {step} did not finish within {timeout}s") from exc


def run_installed(
    venv: Path, cwd: Path, program: str, *args: str
) -> subprocess.CompletedProcess[str]:
    """Run ``venv/bin/program`` with a clean environment."""
    return subprocess.run(
        [str(venv / "bin" / program), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_clean_env(),
        timeout=QUICK_TIMEOUT_S,
        check=False,
    )


def _docker_steps(dockerfile: str) -> list[str]:
    """The ``RUN`` and ``COPY`` instructions, in order, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", dockerfile)
    return [ln.strip() for ln in joined.splitlines() if re.match(r"\s*(RUN|COPY)\b", ln)]


def test_allow_list_parser() -> None:
    assert allow_list("# c\n*\n!a.txt\n!dir/\n**/__pycache__\n") == ["a.txt", "dir"]
    with pytest.raises(ValueError, match="must start with '\\*'"):
        allow_list("!a.txt\n")
    with pytest.raises(ValueError, match="'secrets/' is neither"):
        allow_list("*\nsecrets/\n")


def test_dockerfile_installs_only_through_the_script() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    steps = _docker_steps(dockerfile)
    runs = [s for s in steps if s.startswith("RUN")]
    assert re.findall(r"docker/install\.sh (\w+)", "\n".join(runs)) == ["torch", "project"]
    # pip is never called directly: what the test replays is all the image installs.
    assert not [s for s in runs if "pip" in s]
    assert "ARG TORCH_VARIANT=cpu" in dockerfile
    assert re.search(r"^USER 10001", dockerfile, re.MULTILINE)
    assert len(re.findall(r"^FROM ", dockerfile, re.MULTILINE)) == 2
    # Every file the builder copies must be inside the build context.
    allowed = allow_list((REPO / ".dockerignore").read_text())
    for step in steps:
        if step.startswith("COPY") and "--from=" not in step:
            for source in step.split()[1:-1]:
                assert source.rstrip("/") in allowed, f"{step!r}: {source} is not in the context"


def test_script_refuses_an_unknown_torch_variant(tmp_path: Path) -> None:
    src = copy_context(tmp_path / "src")
    venv = tmp_path / "venv"
    done = run_script("torch", venv, src, QUICK_TIMEOUT_S, TORCH_VARIANT="rocm6")
    assert done.returncode == 2
    assert "TORCH_VARIANT 'rocm6'" in done.stderr
    assert not venv.exists()


def test_script_refuses_an_unknown_step(tmp_path: Path) -> None:
    src = copy_context(tmp_path / "src")
    done = run_script("everything", tmp_path / "venv", src, QUICK_TIMEOUT_S)
    assert done.returncode == 2
    assert "usage:" in done.stderr
    assert not (tmp_path / "venv").exists()


@pytest.mark.timeout(2 * INSTALL_TIMEOUT_S + 120)
def test_image_install_steps_give_working_entrypoints(tmp_path: Path) -> None:
    src = copy_context(tmp_path / "src")
    venv = tmp_path / "venv"
    for step in ("torch", "project"):
        done = run_script(step, venv, src, INSTALL_TIMEOUT_S, TORCH_INDEX_URL="")
        assert done.returncode == 0, f"install.sh {step}:\n{done.stdout[-3000:]}{done.stderr}"
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()

    # Run from an unrelated directory, so only the installed copy can be imported.
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for entry in ENTRYPOINTS:
        done = run_installed(venv, outside, entry, "--help")
        assert done.returncode == 0, f"{entry} --help: {done.stderr}"
        assert "usage" in done.stdout.lower(), done.stdout

    probe = run_installed(
        venv,
        outside,
        "python",
        "-c",
        "import refit_operator, refit_worker, torch, nixl, sys;"
        "print(torch.__version__); print(refit_operator.__file__); print(sys.prefix)",
    )
    assert probe.returncode == 0, probe.stderr
    torch_version, operator_file, prefix = probe.stdout.split()
    assert torch_version.startswith("2.13.0")
    assert Path(operator_file).is_relative_to(venv)
    assert Path(prefix) == venv

    # The installed CLI carries the same CRD as the checkout (package data made it in).
    crd = run_installed(venv, outside, "refit", "crd")
    assert crd.returncode == 0, crd.stderr
    assert yaml.safe_load(crd.stdout) == yaml.safe_load((REPO / "crds/refitjob.yaml").read_text())
