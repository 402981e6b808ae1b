"""A tensor-parallel vLLM worker's part: what it declares, expects and hands vLLM's loader."""

from __future__ import annotations

import pytest
import torch

from refit_worker.contract.config import ConfigError, RendezvousConfig, WorkerConfig
from refit_worker.integrations.vllm.served_shards import Declaration
from refit_worker.integrations.vllm.worker_part import WorkerPart, _worker_rank

FULL = {"emb": (6, 3), "o": (3, 4), "norm": (3,)}
PART = WorkerPart(Declaration(1, 2, {"emb": (0, 4, 6), "o": (1, 2, 4)}, frozenset()), FULL)


def test_declared_layout_and_local_shapes() -> None:
    layout = PART.layout
    assert (layout.tp_rank, layout.tp_size) == (1, 2)
    assert layout.slices == {"emb": (0, 4, 6), "o": (1, 2, 4)}
    assert PART.local() == {"emb": (2, 3), "o": (3, 2), "norm": (3,)}


def test_widen_puts_each_part_where_the_loader_narrows() -> None:
    emb, o, norm = torch.randn(2, 3), torch.randn(3, 2), torch.randn(3)
    wide = PART.widen({"emb": emb, "o": o, "norm": norm})
    assert wide["emb"].shape == (6, 3) and wide["o"].shape == (3, 4)
    # What vLLM's loader reads for tensor-parallel rank 1 of 2: exactly the part sent.
    assert torch.equal(wide["emb"].narrow(0, 4, 2), emb)
    assert torch.equal(wide["o"].narrow(1, 2, 2), o)
    assert wide["norm"] is norm  # held whole: handed on as it came
    assert list(wide) == ["emb", "o", "norm"] and len(wide) == 3


def _config(rank: int, rollouts: int) -> WorkerConfig:
    return WorkerConfig(
        job="j",
        role="rollout",
        rank=rank,
        policy_world_size=1,
        rollout_world_size=rollouts,
        rendezvous=RendezvousConfig(store="file", location="/tmp/x"),
    )


def test_each_worker_is_its_own_rank() -> None:
    assert _worker_rank(_config(2, 4), 1).rank == 3
    with pytest.raises(ConfigError, match="outside the rollout world size 2"):
        _worker_rank(_config(0, 2), 2)
