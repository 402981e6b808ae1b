"""How a job's signing key is named where people read it (status, events, logs)."""

from __future__ import annotations

import hashlib


def fingerprint(public: bytes) -> str:
    """A short, stable name of an Ed25519 public key: ``ed25519:<16 hex digits of its
    SHA-256>`` (the operator's event, each rank's reports and the status all use it)."""
    return f"ed25519:{hashlib.sha256(public).hexdigest()[:16]}"


__all__ = ["fingerprint"]
