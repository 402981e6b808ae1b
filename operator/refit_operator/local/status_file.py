"""``refit run --status-file PATH``: the final RefitJob as JSON, as ``kubectl get -o json``
would print it (apiVersion, kind, metadata, spec and status), for scripts and CI.

The path is checked before the run starts (:func:`problem`: nothing is created or
changed by the check), and the file is written once at the end, whatever the outcome,
by a rename so a reader never sees half of it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from refit_operator.api.models import API_VERSION, KIND, RefitJobStatus
from refit_operator.core.decision import JobView


def problem(path: Path) -> str | None:
    """Why ``path`` cannot take the status file, or None; looks only, changes nothing."""
    where = path.expanduser()
    parent = where.parent
    if not parent.exists():
        return f"--status-file {path}: directory {parent} does not exist"
    if not parent.is_dir():
        return f"--status-file {path}: {parent} is not a directory"
    if where.is_dir():
        return f"--status-file {path}: is a directory"
    # The file is written beside itself and renamed over: the directory must be writable.
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--status-file {path}: directory {parent} is not writable"
    if where.exists() and not os.access(where, os.W_OK):
        return f"--status-file {path}: not writable"
    return None


def job_object(
    manifest: Mapping[str, Any], job: JobView | None, status: RefitJobStatus
) -> dict[str, Any]:
    """The RefitJob as the API would return it: the manifest's metadata with what the run
    gave it (namespace, uid, generation), the spec as it ended (a scale changes it), and
    the status without unset fields (the API server keeps no nulls)."""
    metadata = dict(manifest.get("metadata") or {})
    spec: Any = manifest.get("spec")
    if job is not None:
        metadata.update(namespace=job.ref.namespace, uid=job.ref.uid, generation=job.generation)
        spec = job.raw_spec
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": spec,
        "status": status.model_dump(mode="json", by_alias=True, exclude_none=True),
    }


def write(path: Path, obj: Mapping[str, Any]) -> None:
    """Write ``obj`` to ``path`` whole (a temporary file beside it, renamed over)."""
    where = path.expanduser()
    temporary = where.with_name(f".{where.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
        os.replace(temporary, where)
    finally:
        temporary.unlink(missing_ok=True)
