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
from tests.support.bad_manifests import BAD_FILES, BAD_SPECS, BASE, manifest_text
from tests.support.crd_judge import crd_verdict

from refit_operator.local.command import EXIT_BAD_MANIFEST, ManifestError, cmd_run, load_manifest
from refit_operator.models import InvalidSpecError, parse_spec


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


@pytest.mark.parametrize(
    ("spec", "words"), [r[1:] for r in BAD_SPECS], ids=[r[0] for r in BAD_SPECS]
)
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
    path = tmp_path / "job.yaml"
    path.write_text(manifest_text(spec))
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
    assert cmd_run(args, out=out) == EXIT_BAD_MANIFEST
    err = capsys.readouterr().err
    assert err.startswith("refit run: ") and all(w in err for w in words)
    assert out.getvalue() == ""
    assert not workdir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]
