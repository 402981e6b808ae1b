"""What a local run accepts but does not act on: settings only a cluster gives meaning to.

``refit run`` validates the whole manifest as the operator does, so a job can go from a
laptop to a cluster unchanged; but on one machine with no scheduler, no image pulls and no
controllers, some settings have nothing to act on.  Saying so once at the start is better
than a user wondering why a toleration or a TTL "did nothing".

Pure: reads the raw (already validated) spec; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Why each group of settings means nothing here, and the pod template fields in it.
_TEMPLATE_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "one node, no scheduler",
        (
            "nodeSelector",
            "affinity",
            "tolerations",
            "topologySpreadConstraints",
            "priorityClassName",
            "schedulerName",
            "runtimeClassName",
        ),
    ),
    ("no image pulls: workers run from this Python environment", ("imagePullSecrets",)),
    ("no API server: nothing reads the pods' labels or annotations", ()),
)
_JOB_FIELDS: tuple[tuple[str, str], ...] = (
    ("ttlSecondsAfterFinished", "the run ends with the job: there is no object to delete"),
)


def ignored(raw_spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(setting, why) for each cluster-only setting the spec holds; spec.image first."""
    found: list[tuple[str, str]] = [
        ("image", "no image pulls: workers run from this Python environment")
    ]
    for field, why in _JOB_FIELDS:
        if raw_spec.get(field) is not None:
            found.append((field, why))
    for role in ("policy", "rollout"):
        role_spec = raw_spec.get(role) or {}
        if (role_spec.get("resources") or {}).get("limits") or (
            role_spec.get("resources") or {}
        ).get("requests"):
            found.append((f"{role}.resources", "no kubelet enforces requests or limits here"))
        template = role_spec.get("template") or {}
        pod = template.get("spec") or {}
        for why, fields in _TEMPLATE_GROUPS:
            for field in fields:
                if pod.get(field):
                    found.append((f"{role}.template.spec.{field}", why))
        meta = template.get("metadata") or {}
        for field in ("labels", "annotations"):
            if meta.get(field):
                found.append((f"{role}.template.metadata.{field}", _TEMPLATE_GROUPS[2][0]))
    return found


def ignored_line(raw_spec: Mapping[str, Any]) -> str:
    """One line naming what is ignored, grouped by why."""
    by_reason: dict[str, list[str]] = {}
    for field, why in ignored(raw_spec):
        by_reason.setdefault(why, []).append(field)
    parts = [f"{', '.join(fields)} ({why})" for why, fields in by_reason.items()]
    return "refit run: ignored on one machine: " + "; ".join(parts)
