"""What the versions ledger (issue #32) should say of a synthetic-weights job."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from refit_operator.api.models import parse_spec
from refit_worker.engine.messages.integrity import tensors_digest
from refit_worker.pod.weights import synthetic_state_dict


def trainer_digest(spec: Mapping[str, Any], refit: int) -> str:
    """The digest of the synthetic model ``spec`` names as the trainer sends it at
    ``refit`` (refit k carries the weights after training step k + 1), regenerated here:
    what a replica that serves that refit must report."""
    weights = parse_spec(dict(spec)).weights.synthetic
    assert weights is not None, "a synthetic-weights job"
    return tensors_digest(synthetic_state_dict(weights, refit + 1))


def served_ranks(status: Mapping[str, Any]) -> list[int]:
    """Every rollout rank the status's ledger lists, in order."""
    return sorted(rank for row in status.get("versions") or [] for rank in row["replicas"])


_KEY_EVENT = re.compile(r"job key (ed25519:[0-9a-f]{16}) in Secret ")


def job_key(messages: Iterable[str]) -> str:
    """The job's key as the operator's ``SigningKeyCreated`` event names it (one per job)."""
    found = {m.group(1) for text in messages for m in _KEY_EVENT.finditer(text)}
    assert len(found) == 1, f"one SigningKeyCreated key expected, found {sorted(found)}"
    return found.pop()
