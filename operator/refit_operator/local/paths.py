"""Relative script paths in a local run's commands, read from the manifest's directory.

On a cluster a role's ``command: [python, session_job.py]`` names a file in the image.
A local run has no image, and every pod runs in a directory of its own, so a relative
path would be looked up there and missed.  As docker compose reads paths from the
compose file's directory, ``refit run`` reads a relative command or args entry that names
an existing file next to the manifest as that file (and says so).

Pure apart from checking which files exist.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any


def resolve(raw_spec: dict[str, Any], base: Path) -> tuple[dict[str, Any], list[str]]:
    """``raw_spec`` with each such entry made absolute, and one note per change."""
    spec = copy.deepcopy(raw_spec)
    notes = []
    for role in ("policy", "rollout"):
        role_spec = spec.get(role)
        if not isinstance(role_spec, dict):
            continue
        for field in ("command", "args"):
            entries = role_spec.get(field)
            if not isinstance(entries, list):
                continue
            for i, entry in enumerate(entries):
                if not isinstance(entry, str) or not entry or Path(entry).is_absolute():
                    continue
                local = (base / entry).resolve()
                if local.is_file():
                    entries[i] = str(local)
                    notes.append(f"{role}.{field}: {entry} -> {local}")
    return spec, notes
