"""Checkpoint engines: move a model's named tensors from policy ranks to rollout ranks.

Public names mirror upstream ``nemo_rl.utils.checkpoint_engines`` (``NIXLCheckpointEngine``,
``NixlAgent``, ``resolve_nixl_backend_kwargs``, ``preinit_nixl_agent``, ...).  Planning,
mapping, layouts and messages are pure and importable without nixl; nixl itself is imported
only when an agent is created.

DTensor weights (FSDP2, tensor parallel) are sent shard by shard: :mod:`.boxes` and
:mod:`.shard_plan` plan it (pure), :mod:`.shards` reads the DTensors.

Must not import: the operator, torch.distributed's collectives (DTensor types only, in
:mod:`.shards`).
"""

from .agent import (
    NIXL_DEFAULT_BACKEND_NAME,
    NIXL_TRANSFER_BUFFER_COUNT,
    NixlAgent,
    PeerError,
    RefitTimeoutError,
    preinit_nixl_agent,
    resolve_nixl_backend_kwargs,
)
from .base import CheckpointEngine, RefitTiming, TensorMeta
from .layout import TargetWeightLayout
from .mapping import (
    _source_rank_for_rollout,
    bucket_sender,
    rollout_targets_for_policy,
    source_ranks_for_rollout,
)
from .messages import BufferDesc, NixlAgentMetadata, ProtocolError
from .nixl import NIXLCheckpointEngine, ReceivedRefit
from .planning import TensorSpec, plan_buckets
from .receiver import IncompleteRefitError, LayoutMismatchError

__all__ = [
    "NIXL_DEFAULT_BACKEND_NAME",
    "NIXL_TRANSFER_BUFFER_COUNT",
    "BufferDesc",
    "CheckpointEngine",
    "IncompleteRefitError",
    "LayoutMismatchError",
    "NIXLCheckpointEngine",
    "NixlAgent",
    "NixlAgentMetadata",
    "PeerError",
    "ProtocolError",
    "ReceivedRefit",
    "RefitTimeoutError",
    "RefitTiming",
    "TargetWeightLayout",
    "TensorMeta",
    "TensorSpec",
    "_source_rank_for_rollout",
    "bucket_sender",
    "plan_buckets",
    "preinit_nixl_agent",
    "resolve_nixl_backend_kwargs",
    "rollout_targets_for_policy",
    "source_ranks_for_rollout",
]
