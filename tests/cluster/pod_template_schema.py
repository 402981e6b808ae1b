"""Write ``operator/refit_operator/api/schemas/pod-template-spec.json``: the PodTemplateSpec
schema the cluster tier's kube-apiserver serves, in CRD structural form.

    python -m tests.cluster.pod_template_schema          # rewrite the checked-in file
    python -m tests.cluster.pod_template_schema --check  # exit 1 if it differs

Starts the control plane of ``build.sh`` (cached binaries: a few seconds), reads
``/openapi/v3/api/v1`` and ``/version``, converts with
``tests/support/openapi_structural.py``.  Run it after moving the tier to another
Kubernetes release, then ``refit crd > crds/refitjob.yaml``.

Must not import: kopf, kubernetes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.binaries import REPO_ROOT
from tests.cluster.controlplane import ControlPlane, build
from tests.cluster.rest import Rest
from tests.support.openapi_structural import pod_template_schema

TARGET = REPO_ROOT / "operator" / "refit_operator" / "api" / "schemas" / "pod-template-spec.json"


def served(rest: Rest) -> dict[str, Any]:
    """The checked-in file's content, from what ``rest``'s apiserver serves."""
    version = rest.get("/version")["gitVersion"]
    schemas = rest.get("/openapi/v3/api/v1")["components"]["schemas"]
    return {
        "kubernetesVersion": version,
        "source": "kube-apiserver /openapi/v3/api/v1, io.k8s.api.core.v1.PodTemplateSpec",
        "schema": pod_template_schema(schemas),
    }


def render(content: dict[str, Any]) -> str:
    return json.dumps(content, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    built = build()
    with tempfile.TemporaryDirectory() as tmp, ControlPlane(built.bin_dir, Path(tmp)) as plane:
        text = render(served(Rest(plane.server, plane.token, plane.ca_file)))
    if args.check:
        same = TARGET.exists() and TARGET.read_text() == text
        print(f"{TARGET}: {'up to date' if same else 'differs from the apiserver'}")
        return 0 if same else 1
    TARGET.write_text(text)
    print(f"wrote {TARGET} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
