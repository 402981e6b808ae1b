"""Reading a RefitJob manifest file for ``refit run``, judged exactly as the operator would.

One object of kind RefitJob, the right apiVersion, a name and namespace Kubernetes
accepts, and a spec the models accept; otherwise :class:`ManifestError` saying where and
why (a misspelt kind gets "did you mean").  Nothing is started here.

Must not import: kopf, kubernetes.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml

from refit_operator import names
from refit_operator.models import API_VERSION, InvalidSpecError, RefitJobSpec, parse_spec

_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class ManifestError(ValueError):
    """The file is not a valid RefitJob manifest; the message says where and why."""


def load_manifest(path: Path) -> tuple[dict[str, Any], RefitJobSpec]:
    """Read and validate a RefitJob manifest exactly as the operator would."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(
            f"{path}: not a YAML manifest: byte {exc.start} is not UTF-8 text"
        ) from exc
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: not valid YAML: {exc}") from exc
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == "RefitJob"]
    if len(jobs) != 1:
        raise ManifestError(
            f"{path}: expected exactly one object of kind RefitJob, found {len(jobs)}"
            f" ({_kinds_found(docs)})"
        )
    manifest = jobs[0]
    expected = API_VERSION
    if manifest.get("apiVersion") != expected:
        raise ManifestError(
            f"{path}: apiVersion is {manifest.get('apiVersion')!r}, expected {expected!r}"
        )
    meta = manifest.get("metadata")
    if not isinstance(meta, dict) or meta.get("name") is None:
        raise ManifestError(f"{path}: metadata.name is required")
    if not isinstance(meta["name"], str):
        raise ManifestError(
            f"{path}: metadata.name must be a string, got {type(meta['name']).__name__}"
            f" {meta['name']!r} (quote it in YAML)"
        )
    namespace = meta.get("namespace", "default")
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise ManifestError(
            f"{path}: metadata.namespace {namespace!r} must be a DNS-1123 label"
            " (lowercase letters, digits and '-', at most 63 characters)"
        )
    try:
        spec = parse_spec(manifest.get("spec"))
    except InvalidSpecError as exc:
        raise ManifestError(f"{path}: invalid spec: {exc}") from exc
    problems = names.name_problems(meta["name"], spec.policy.replicas, spec.rollout.replicas)
    if problems:
        raise ManifestError(f"{path}: metadata.name: {'; '.join(problems)}")
    return manifest, spec


def _kinds_found(docs: list[Any]) -> str:
    kinds = [str(d.get("kind")) if isinstance(d, dict) else type(d).__name__ for d in docs]
    if not kinds:
        return "the file holds no YAML document"
    near = [k for k in kinds if k != "RefitJob" and _near_kind(k)]
    hint = f"; did you mean RefitJob, not {near[0]}?" if near else ""
    return "the file holds: " + ", ".join(kinds) + hint


def _near_kind(kind: str) -> bool:
    """A misspelt RefitJob: another case, a plural, a typo or two."""
    return difflib.SequenceMatcher(None, kind.lower(), "refitjob").ratio() >= 0.75
