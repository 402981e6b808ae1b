"""What a writer fills in as it creates: the job's signing Secret gets a fresh Ed25519 key
pair (the OS's randomness, at the moment of the create), and the Event that says which key
the job's refits are sealed with.

Both shells' writers call these (the controller's ``shell/kube_writes.py``, ``refit run``'s
``local/runner.py``); the Secret itself is rendered without data by
``render/signing_key.py``.
"""

from __future__ import annotations

import base64
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from refit_operator.core.decision import Emit
from refit_operator.render.signing_key import KEY_ANNOTATION, PRIVATE, PUBLIC
from refit_worker.contract.keys import fingerprint


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


__all__ = ["created_event", "fingerprint_of", "with_fresh_key"]
