"""Checkpoint engines: move a model's named tensors from policy ranks to rollout ranks.

Public names mirror upstream ``nemo_rl.utils.checkpoint_engines`` (``NIXLCheckpointEngine``,
``NixlAgent``, ``resolve_nixl_backend_kwargs``, ``preinit_nixl_agent``, ...).  Planning,
mapping, layouts and messages are pure and importable without nixl; nixl itself is imported
only when an agent is created.

Membership (:mod:`.peers`, :mod:`.delivery`, :mod:`.admission`): peers follow the
rendezvous's member list with ``update_peers``; a refit goes to the members present, a
failing target is dropped from it alone, and a receiver declines a refit it should not
take (an older one, or one its sources planned from different memberships).

DTensor weights (FSDP2, tensor parallel) are sent shard by shard: :mod:`.boxes` and
:mod:`.shard_plan` plan it (pure), :mod:`.shards` reads the DTensors.
"""

from .admission import RefitDeclinedError
from .agent import (
    NIXL_DEFAULT_BACKEND_NAME,
    NIXL_TRANSFER_BUFFER_COUNT,
    DeclinedError,
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
from .peers import PeerUpdate, targets_for_policy
from .planning import TensorSpec, plan_buckets
from .receiver import IncompleteRefitError, LayoutMismatchError

__all__ = [
    "NIXL_DEFAULT_BACKEND_NAME",
    "NIXL_TRANSFER_BUFFER_COUNT",
    "BufferDesc",
    "CheckpointEngine",
    "DeclinedError",
    "IncompleteRefitError",
    "LayoutMismatchError",
    "NIXLCheckpointEngine",
    "NixlAgent",
    "NixlAgentMetadata",
    "PeerError",
    "PeerUpdate",
    "ProtocolError",
    "ReceivedRefit",
    "RefitDeclinedError",
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
    "targets_for_policy",
]
