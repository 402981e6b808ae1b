"""The job's signing key: one Ed25519 key pair per RefitJob, the trainer's root of trust.

The operator creates a Secret per job holding both halves.  Policy pods get the private
half, rollout pods the public half, each as one environment variable the kubelet reads
from the Secret (``secretKeyRef``): no worker can read the Secret through the API (the
workers' Roles grant nothing on Secrets), and a rollout pod never sees the private half.

Rendering is pure and holds no key: :func:`render_secret` gives the Secret with its data
left out, and the shell that creates it (:func:`with_fresh_key`, called by the writers)
makes the key at that moment.  The Secret is created once, like every static child, and
never rewritten: a running gang keeps the key it started with.

Must not import: kopf, kubernetes, aiohttp.
"""

from __future__ import annotations

import base64
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from refit_operator.api import names
from refit_operator.core.decision import Emit
from refit_worker.contract.config import KEY_FIELDS
from refit_worker.contract.keys import fingerprint

#: Marks the one Secret whose data the writer fills with a fresh key.
KEY_ANNOTATION = "refit.kube-refit.io/signing-key"
PRIVATE, PUBLIC = KEY_FIELDS["signing_key"], KEY_FIELDS["verify_key"]


def render_secret(job: str, namespace: str) -> dict[str, Any]:
    """The job's signing Secret, without its data (see :func:`with_fresh_key`) or owner."""
    meta = {
        "name": names.signing_secret_name(job),
        "namespace": namespace,
        "labels": names.job_labels(job),
        "annotations": {KEY_ANNOTATION: "ed25519"},
    }
    # immutable: nobody, the operator included, swaps the key under a running gang.
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque"}
    return {**secret, "immutable": True}


def with_fresh_key(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with a new key pair in its data when it is a signing Secret; else ``obj``."""
    annotations = obj.get("metadata", {}).get("annotations") or {}
    if obj.get("kind") != "Secret" or KEY_ANNOTATION not in annotations:
        return obj
    key = Ed25519PrivateKey.generate()  # the OS's randomness
    halves = {PRIVATE: key.private_bytes_raw(), PUBLIC: key.public_key().public_bytes_raw()}
    # Each value is the key's base64 text, as the worker reads it from its environment.
    data = {key: _b64(_b64(raw).encode()) for key, raw in halves.items()}
    return {**obj, "data": data}


def fingerprint_of(obj: dict[str, Any]) -> str | None:
    """The fingerprint of the public key a filled signing Secret holds (None: not one)."""
    public = (obj.get("data") or {}).get(PUBLIC) if obj.get("kind") == "Secret" else None
    if public is None:
        return None
    return fingerprint(base64.b64decode(base64.b64decode(public)))


def created_event(obj: dict[str, Any]) -> Emit | None:
    """The Event that says which key a just-created signing Secret holds."""
    key = fingerprint_of(obj)
    if key is None:
        return None
    message = (
        f"job key {key} in Secret {obj['metadata']['name']}: policy pods seal every refit "
        "with it, rollout pods commit only what it sealed"
    )
    return Emit("Normal", "SigningKeyCreated", message)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


__all__ = ["created_event", "fingerprint_of", "render_secret", "with_fresh_key"]
