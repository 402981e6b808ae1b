"""The job's signing key: one Ed25519 key pair per RefitJob, the trainer's root of trust.

The operator creates a Secret per job holding both halves.  Policy pods get the private
half, rollout pods the public half, each as one environment variable the kubelet reads
from the Secret (``secretKeyRef``): no worker can read the Secret through the API (the
workers' Roles grant nothing on Secrets), and a rollout pod never sees the private half.

Rendering is pure and holds no key: :func:`render_secret` gives the Secret with its data
left out, and the writer that creates it makes the key at that moment
(``apply/fresh_key.py``).  The Secret is created once, like every static child, and never
rewritten: a running gang keeps the key it started with.
"""

from __future__ import annotations

from typing import Any

from refit_operator.api import names
from refit_worker.contract.config import KEY_FIELDS

#: Marks the one Secret whose data the writer fills with a fresh key.
KEY_ANNOTATION = "refit.kube-refit.io/signing-key"
PRIVATE, PUBLIC = KEY_FIELDS["signing_key"], KEY_FIELDS["verify_key"]


def render_secret(job: str, namespace: str) -> dict[str, Any]:
    """The job's signing Secret, without its data (``apply/fresh_key.py`` fills it) or owner."""
    meta = {
        "name": names.signing_secret_name(job),
        "namespace": namespace,
        "labels": names.job_labels(job),
        "annotations": {KEY_ANNOTATION: "ed25519"},
    }
    # immutable: nobody, the operator included, swaps the key under a running gang.
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque"}
    return {**secret, "immutable": True}


__all__ = ["KEY_ANNOTATION", "PRIVATE", "PUBLIC", "render_secret"]
