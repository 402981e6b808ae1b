"""The job's key halves from a worker's config: what seals (policy) and what checks
(rollout) every refit (:mod:`refit_worker.engine.messages.signing`).
"""

from __future__ import annotations

import base64

from refit_worker.contract.config import WorkerConfig
from refit_worker.engine import RefitSigner, RefitVerifier


def signer_of(config: WorkerConfig) -> RefitSigner | None:
    """A policy rank's signer (None: the pod got no key, refits go unsigned)."""
    if config.role != "policy" or not config.signing_key:
        return None
    return RefitSigner(base64.b64decode(config.signing_key))


def verifier_of(config: WorkerConfig) -> RefitVerifier | None:
    """A rollout rank's verifier (None: the pod got no key, refits are taken unsigned)."""
    if config.role != "rollout" or not config.verify_key:
        return None
    return RefitVerifier(base64.b64decode(config.verify_key))


__all__ = ["signer_of", "verifier_of"]
