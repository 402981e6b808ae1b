"""Bad RefitJob manifests (the corpus in ``tests/support/bad_manifests.py``), each refused
with a message naming field and value.

Every spec row goes three ways: :func:`parse_spec` (the operator), ``load_manifest`` (what
``refit run`` reads from a file), and the generated CRD judged offline
(``tests/support/crd_judge.py``), which must refuse it too.  Manifest rows (YAML, kind,
apiVersion, name) only reach ``load_manifest``.  ``refit run`` on a bad manifest exits 2,
prints the message and creates nothing.

Real: the models, the CLI's loader and command, files on disk.  Nothing emulated.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

import pytest
from tests.support.bad_manifests import (
    BAD_FILES,
    BAD_SPECS,
    BASE,
    ISSUE_50_FILES,
    NOT_IN_YAML,
    manifest_text,
)
from tests.support.crd_judge import crd_verdict

from refit_operator.api.models import InvalidSpecError, parse_spec
from refit_operator.local.command import EXIT_BAD_MANIFEST, ManifestError, cmd_run, load_manifest
from refit_operator.local.manifest import load_yaml_documents

#: The spec rows a YAML file can carry as written (see ``NOT_IN_YAML``).
IN_YAML = [r for r in BAD_SPECS if r[0] not in NOT_IN_YAML]


def test_the_table_is_large_and_its_base_is_valid() -> None:
    assert len(BAD_SPECS) + len(BAD_FILES) >= 50
    assert len({row[0] for row in BAD_SPECS + BAD_FILES}) == len(BAD_SPECS) + len(BAD_FILES)
    parse_spec(BASE)
    assert crd_verdict(BASE) == []


@pytest.mark.parametrize(
    ("spec", "words"), [r[1:] for r in BAD_SPECS], ids=[r[0] for r in BAD_SPECS]
)
def test_parse_spec_names_field_and_value(spec: Any, words: tuple[str, ...]) -> None:
    with pytest.raises(InvalidSpecError) as info:
        parse_spec(spec)
    for word in words:
        assert word in str(info.value)
    assert crd_verdict(spec) != [], "the CRD would store what the operator refuses"


@pytest.mark.parametrize(("spec", "words"), [r[1:] for r in IN_YAML], ids=[r[0] for r in IN_YAML])
def test_refit_run_loader_gives_the_same_message(
    spec: Any, words: tuple[str, ...], tmp_path: Path
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(manifest_text(spec))
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert str(info.value).startswith(f"{path}: invalid spec: ")
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("text", "words"), [r[1:] for r in BAD_FILES], ids=[r[0] for r in BAD_FILES]
)
def test_refit_run_loader_refuses_bad_files(
    text: str, words: tuple[str, ...], tmp_path: Path
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert str(info.value).startswith(f"{path}: ")
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("row", sorted(NOT_IN_YAML))
def test_a_row_yaml_cannot_carry_reads_as_kubectl_sends_it(row: str, tmp_path: Path) -> None:
    """``replicas: 2.0`` in a file is the integer 2 to kubectl, so the API server and
    ``refit run`` accept it alike; the models still refuse the float a JSON client sends."""
    spec = next(r[1] for r in BAD_SPECS if r[0] == row)
    path = tmp_path / "job.yaml"
    path.write_text(manifest_text(spec))
    _, parsed = load_manifest(path)
    assert parsed.policy.replicas == 2
    assert crd_verdict(load_yaml_documents(path.read_text())[0]["spec"]) == []


@pytest.mark.parametrize(
    ("text", "value"),
    [
        # go-yaml v2 (kubectl, helm) reads these as floats; YAML 1.1 as strings.
        ("1e308", 1e308),
        ("1.0e308", 1e308),
        ("-1E-3", -0.001),
        # Go's JSON writes a whole float below 1e21 without its fraction: an integer again.
        ("1e12", 10**12),
        ("2.0", 2),
        ("-3e0", -3),
        ("1e20", 1e20),  # past int64: the API server keeps a float
        ("0.5", 0.5),
        ("10", 10),
        ("1_000", 1000),
        ("0x10", 16),
        # Text stays text.
        ("'1e3'", "1e3"),
        ("1e", "1e"),
        ("e3", "e3"),
        ("1.2.3", "1.2.3"),
        ("v1e3", "v1e3"),
        ("1e3a", "1e3a"),
    ],
)
def test_refit_run_reads_numbers_as_kubectl_sends_them(text: str, value: object) -> None:
    (doc,) = load_yaml_documents(f"x: {text}\n")
    assert doc["x"] == value and type(doc["x"]) is type(value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"nowhere\.yaml: cannot read"):
        load_manifest(tmp_path / "nowhere.yaml")


@pytest.mark.parametrize(
    "row",
    [
        "image missing",
        "reserved env name",
        "unknown signal",
        "synthetic dtype float64",
        # Issue #50: each of these once failed or hung only after the pods started.
        "bucket size 1Ti",
        "bucket size 1",
        "timeout 1e308",
        "synthetic layers 1e12",
    ],
)
def test_refit_run_exits_2_and_creates_nothing(
    row: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec, words = next(r[1:] for r in BAD_SPECS if r[0] == row)
    _assert_refused_before_anything_starts(manifest_text(spec), words, tmp_path, capsys)


@pytest.mark.parametrize(
    ("text", "words"), [r[1:] for r in ISSUE_50_FILES], ids=[r[0] for r in ISSUE_50_FILES]
)
def test_issue_50_inputs_as_written_are_refused_by_refit_run_and_the_crd(
    text: str, words: tuple[str, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each once started the pods and failed (or hung) there.  The CRD judges the spec as
    kubectl sends it (``1e12`` an integer, ``1e308`` a float)."""
    _assert_refused_before_anything_starts(text, words, tmp_path, capsys)
    field = words[0].rsplit(".", 1)[-1]
    verdict = crd_verdict(load_yaml_documents(text)[0]["spec"])
    assert verdict and all(field in problem for problem in verdict), verdict


def _assert_refused_before_anything_starts(
    text: str, words: tuple[str, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``refit run`` on ``text`` exits 2 naming the field, and started nothing: no
    opening line, no working directory, no file beside the manifest."""
    path = tmp_path / "job.yaml"
    path.write_text(text)
    workdir = tmp_path / "work"
    args = argparse.Namespace(
        manifest=path,
        drain_after=None,
        drain_at_refit=None,
        drain_pod=None,
        timeout=60.0,
        workdir=workdir,
        plain=True,
    )
    out = io.StringIO()
    assert cmd_run(args, out=out) == EXIT_BAD_MANIFEST == 2
    err = capsys.readouterr().err
    assert err.startswith("refit run: ") and all(w in err for w in words)
    assert out.getvalue() == ""
    assert not workdir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]
