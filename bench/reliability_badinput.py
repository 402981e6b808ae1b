"""Bad input and security figures, as a markdown section on stdout.

Counts what the bad-input and security suites check, by running their own tables and
generators (not by reading test results): generated RefitJob specs judged by the models and
by the CRD offline, with the agreements; every hand-written bad manifest with the message it
gets; every tampered rendezvous entry with what the operator and a worker make of it; and
the unpickling scan of the source.  ``bench/reliability_report.py`` includes the output in
``docs/reliability.md``.

Usage: ``python bench/reliability_badinput.py [--examples N]`` (default 500 specs).

Must not import: kopf, kubernetes (it needs neither).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "operator"), str(ROOT / "worker")]

from tests.support.bad_manifests import BAD_FILES, BAD_SPECS, NOT_IN_YAML  # noqa: E402
from tests.support.crd_agreement import NOT_GENERATED, run_agreement  # noqa: E402
from tests.support.crd_judge import crd_verdict, model_verdict  # noqa: E402
from tests.support.tampered_entries import (  # noqa: E402
    TAMPERED,
    operator_outcome,
    worker_outcome,
)
from tests.support.unpickle_scan import SCANNED, scan_tree  # noqa: E402

from refit_operator.local.command import ManifestError, load_manifest  # noqa: E402


def _cell(text: str, limit: int = 160) -> str:
    """One markdown table cell: no pipes or newlines, cut to ``limit`` characters."""
    flat = " ".join(text.replace("|", "\\|").split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def agreement_section(examples: int) -> list[str]:
    started = time.monotonic()
    tally = run_agreement(examples)
    seconds = time.monotonic() - started
    lines = [
        "### Models and CRD agree",
        "",
        f"Generated specs judged by `parse_spec` and by the generated CRD (structural schema "
        f"with defaulting and strict fields, then CEL rules by cel-python), in {seconds:.1f} s:",
        "",
        "| generated | valid (models) | valid (CRD) | agreements | disagreements |",
        "|---:|---:|---:|---:|---:|",
        f"| {tally.generated} | {tally.model_valid} | {tally.crd_valid} | {tally.agreements} "
        f"| {len(tally.disagreements)} |",
        "",
    ]
    for spec, crd, model in tally.disagreements[:10]:
        lines.append(
            f"- disagreement: `{_cell(repr(spec))}`: CRD {crd or 'valid'}, "
            f"models {model or 'valid'}"
        )
    lines += ["Not generated, and why:", ""]
    lines += [f"- {what}: {why}" for what, why in NOT_GENERATED.items()]
    return [*lines, ""]


def manifests_section() -> list[str]:
    lines = [
        "### Bad manifests",
        "",
        f"{len(BAD_SPECS)} bad specs and {len(BAD_FILES)} bad files; each spec is refused by "
        "the models and by the CRD, and by `refit run`'s loader with the same message where "
        "a YAML file can carry it ("
        + "; ".join(f"{row}: {why}" for row, why in NOT_IN_YAML.items())
        + ").",
        "",
        "| case | message | CRD refuses |",
        "|---|---|---|",
    ]
    refused = 0
    for name, spec, _words in BAD_SPECS:
        message = model_verdict(spec) or "ACCEPTED"
        crd = bool(crd_verdict(spec))
        refused += message != "ACCEPTED" and crd
        lines.append(f"| {_cell(name, 40)} | {_cell(message)} | {'yes' if crd else 'NO'} |")
    with tempfile.TemporaryDirectory() as folder:
        for name, text, _words in BAD_FILES:
            path = Path(folder) / "job.yaml"
            path.write_text(text)
            try:
                load_manifest(path)
                message = "ACCEPTED"
            except ManifestError as exc:
                message = str(exc).replace(str(path), "job.yaml")
                refused += 1
            lines.append(f"| {_cell(name, 40)} | {_cell(message)} | (file) |")
    total = len(BAD_SPECS) + len(BAD_FILES)
    return [*lines, "", f"Refused as expected: {refused} of {total}.", ""]


def tampered_section() -> list[str]:
    lines = [
        "### Tampered rendezvous entries",
        "",
        "Each value planted on an honest epoch: the operator's coordinator before the "
        "barrier, a worker (real file store) after it.  Pickles are live payloads; none ran.",
        "",
        "| entry | operator | worker |",
        "|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as folder:
        for i, row in enumerate(TAMPERED):
            marker, store = Path(folder) / f"pwned-{i}", Path(folder) / f"store-{i}"
            store.mkdir()
            got = operator_outcome(row, marker), worker_outcome(row, marker, store)
            ran = " (PICKLE RAN)" if marker.exists() else ""
            lines.append(
                f"| {_cell(row.name, 40)} | {_cell(got[0], 110)} | {_cell(got[1], 110)}{ran} |"
            )
    return [*lines, ""]


def scan_section() -> list[str]:
    count, findings = scan_tree(*SCANNED)
    lines = [
        "### Unpickling scan",
        "",
        f"AST scan of {count} modules under `worker/` and `operator/`: {len(findings)} finding(s).",
    ]
    lines += [f"- {f.path}:{f.line}: {f.what}" for f in findings]
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=500, help="generated specs to judge")
    args = parser.parse_args()
    if args.examples < 10:
        parser.error(f"--examples must be at least 10 (got {args.examples})")
    out = ["## Bad input and security", ""]
    out += agreement_section(args.examples)
    out += manifests_section()
    out += tampered_section()
    out += scan_section()
    print("\n".join(out))


if __name__ == "__main__":
    main()
