"""Reading a RefitJob manifest file for ``refit run``, judged exactly as the operator would.

One object of kind RefitJob, the right apiVersion, a name and namespace Kubernetes
accepts, and a spec the models accept; otherwise :class:`ManifestError` saying where and
why (a misspelt kind gets "did you mean").  Numbers are read as ``kubectl apply`` sends
them (``1e308`` a float, ``1e12`` and ``2.0`` integers), so a value is refused here for the
reason the API server gives.  Nothing is started here.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml

from refit_operator.api import names
from refit_operator.api.models import API_VERSION, InvalidSpecError, RefitJobSpec, parse_spec

_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class _KubectlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading plain scalars such as ``1e308`` as numbers.

    kubectl and helm read manifests with go-yaml v2, which takes ``1e308`` and ``1.5e3``
    for floats; PyYAML's YAML 1.1 float needs a dot and a signed exponent, so
    ``timeoutSeconds: 1e308`` would be a string here ("not a valid number") while the API
    server is sent a number (and refuses it for its bound).  Read the same value both ways.
    """


# go-yaml v2's float syntax (its resolve.go), tried after PyYAML's own int and float.
_KubectlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$"),
    list("-+.0123456789"),
)


#: Go's JSON writes a float64 below this without an exponent ("1000000000000" for 1e12),
#: and the API server reads such a whole number back as an int64.
_GO_PLAIN_FLOAT_BELOW = 1e21
_INT64 = range(-(1 << 63), 1 << 63)


def load_yaml_documents(text: str) -> list[Any]:
    """The documents of ``text`` as the operator would see them after ``kubectl apply``
    (numbers such as ``1e12`` included), empty ones left out."""
    docs = yaml.load_all(text, Loader=_KubectlLoader)
    return [_as_stored(d) for d in docs if d is not None]


def _as_stored(value: Any) -> Any:
    """``value`` after kubectl's YAML-to-JSON and the API server's JSON reading: a whole
    float that Go writes without an exponent comes back an integer (``layers: 1e12`` is
    the integer 1000000000000 there, refused for its bound, not for its type)."""
    if isinstance(value, dict):
        return {k: _as_stored(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_stored(v) for v in value]
    if (
        isinstance(value, float)
        and value.is_integer()
        and abs(value) < _GO_PLAIN_FLOAT_BELOW
        and int(value) in _INT64
    ):
        return int(value)
    return value


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
        docs = load_yaml_documents(text)
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
