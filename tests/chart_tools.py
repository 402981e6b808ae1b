"""Running the real helm binary on the chart, for the ``test_chart_*`` modules.

Real: helm v4 (from :mod:`binaries`), the chart on disk, kubernetes-validate's offline
Kubernetes 1.35 schemas.  Nothing is emulated here.

Must not import: the operator, the worker, kopf, kubernetes.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import yaml
from tests.binaries import REPO_ROOT

CHART = REPO_ROOT / "charts" / "refit-operator"
#: The Kubernetes version whose schemas the rendered objects must satisfy (kubectl v1.35).
KUBE_VERSION = "1.35.0"
RELEASE = "refit"
NAMESPACE = "refit-system"
_HELM_TIMEOUT_S = 60.0


class Helm:
    """helm with its cache/config/data homes in a private directory, so runs are hermetic."""

    def __init__(self, binary: Path, home: Path) -> None:
        self.binary = binary
        self.env = {
            **os.environ,
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [str(self.binary), *args],
                capture_output=True,
                text=True,
                env=self.env,
                timeout=_HELM_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"helm {' '.join(args)} ran past {_HELM_TIMEOUT_S}s") from exc

    def template(
        self, values: Mapping[str, Any] | None, tmp: Path, *extra: str
    ) -> subprocess.CompletedProcess[str]:
        """``helm template`` of the chart with ``values`` written to a values file."""
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *extra]
        if values is not None:
            values_file = tmp / "values.yaml"
            values_file.write_text(yaml.safe_dump(dict(values)))
            args += ["--values", str(values_file)]
        return self.run(*args)

    def render(self, values: Mapping[str, Any] | None, tmp: Path) -> list[dict[str, Any]]:
        """The rendered objects; a failed render raises with helm's own message."""
        done = self.template(values, tmp)
        if done.returncode != 0:
            raise RuntimeError(f"helm template failed ({done.returncode}): {done.stderr}")
        return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    if len(found) != 1:
        raise LookupError(f"expected one {kind}, rendered {len(found)}")
    return found[0]


def schema_errors(objects: list[dict[str, Any]]) -> list[str]:
    """Every object that fails the strict Kubernetes schema, as ``Kind/name: message``."""
    errors = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message} at {where}")
    return errors
