"""The engine: move a model's named tensors from policy ranks to rollout ranks over NIXL.

This module is the engine's one face: the sessions, the pod program and the integrations
import from here, never from the folders below (an import-linter contract holds it).  Public
names mirror upstream ``nemo_rl.utils.checkpoint_engines`` (``NIXLCheckpointEngine``,
``NixlAgent``, ``resolve_nixl_backend_kwargs``, ``preinit_nixl_agent``, ...); nixl itself is
imported only when an agent is created.

The folders, top to bottom (a folder imports only those below it; ``policy`` and ``rollout``
are independent):

* ``nixl``: :class:`NIXLCheckpointEngine`, upstream's engine, holding either role;
* ``policy/`` and ``rollout/``: each role's part of a refit (a policy rank plans and WRITEs,
  a rollout rank admits, lands, verifies, and offers or pulls peer seeds);
* ``transport/`` (the NIXL agent, memory registrations, the peers followed through the
  membership, what both roles share) and ``delta/`` (the codec of delta refits);
* ``planning/`` (rank mapping, bucket and shard plans, box geometry, target layouts: pure)
  and ``messages/`` (the typed wire, integrity hashes, signatures);
* ``base``: upstream's engine-neutral contract (:class:`CheckpointEngine`,
  :class:`TensorMeta`, dtypes by name).
"""

from .base import (
    SAME_WIDTH_INT,
    WIRE_DTYPES,
    CheckpointEngine,
    RefitTiming,
    TensorMeta,
    dtype_from_name,
)
from .delta.blocks import (
    BlocksKey,
    block_ref,
    blocks_digest,
    blocks_key,
    encoded_here,
    hash_blocks,
    merge_hashes,
    merge_pieces,
    state_blocks_digest,
)
from .delta.codec import (
    DELTA_TENSOR,
    Delta,
    DeltaArena,
    apply_delta,
    base_bytes,
    blocks_algorithm,
    encode_delta,
    scatter_changes,
    worth_sending,
)
from .messages.integrity import Algorithm, algorithm_for, tensors_digest
from .messages.known_hashes import KnownHash
from .messages.signing import RefitSigner, RefitVerifier, SealRecord
from .messages.wire import (
    BlockHash,
    BlockRef,
    DeltaEntry,
    DeltaHeader,
    NixlAgentMetadata,
    ProtocolError,
)
from .nixl import NIXLCheckpointEngine
from .planning.boxes import Box
from .planning.buckets import TensorSpec
from .planning.layout import TargetWeightLayout
from .policy.dtensors import ShardedSource, is_sharded, local_sources
from .policy.policy_side import DeltaNotApplicable
from .rollout.admission import RefitDeclinedError
from .rollout.refit_receive import (
    DeltaTarget,
    IncompleteRefitError,
    LayoutMismatchError,
    TargetResolver,
)
from .rollout.rollout_side import ReceivedRefit
from .rollout.seed_transfer import (
    Seeded,
    SeedError,
    SeedOffer,
    SeedSource,
    metadata_from_pointer,
    pointer_metadata,
    pull,
)
from .transport.agent import (
    NIXL_DEFAULT_BACKEND_NAME,
    NIXL_TRANSFER_BUFFER_COUNT,
    DeclinedError,
    NixlAgent,
    PeerError,
    RefitTimeoutError,
    preinit_nixl_agent,
    resolve_nixl_backend_kwargs,
)
from .transport.peers import targets_for_policy

__all__ = [
    "DELTA_TENSOR",
    "NIXL_DEFAULT_BACKEND_NAME",
    "NIXL_TRANSFER_BUFFER_COUNT",
    "SAME_WIDTH_INT",
    "WIRE_DTYPES",
    "Algorithm",
    "BlockHash",
    "BlockRef",
    "BlocksKey",
    "Box",
    "CheckpointEngine",
    "DeclinedError",
    "Delta",
    "DeltaArena",
    "DeltaEntry",
    "DeltaHeader",
    "DeltaNotApplicable",
    "DeltaTarget",
    "IncompleteRefitError",
    "KnownHash",
    "LayoutMismatchError",
    "NIXLCheckpointEngine",
    "NixlAgent",
    "NixlAgentMetadata",
    "PeerError",
    "ProtocolError",
    "ReceivedRefit",
    "RefitDeclinedError",
    "RefitSigner",
    "RefitTimeoutError",
    "RefitTiming",
    "RefitVerifier",
    "SealRecord",
    "SeedError",
    "SeedOffer",
    "SeedSource",
    "Seeded",
    "ShardedSource",
    "TargetResolver",
    "TargetWeightLayout",
    "TensorMeta",
    "TensorSpec",
    "algorithm_for",
    "apply_delta",
    "base_bytes",
    "block_ref",
    "blocks_algorithm",
    "blocks_digest",
    "blocks_key",
    "dtype_from_name",
    "encode_delta",
    "encoded_here",
    "hash_blocks",
    "is_sharded",
    "local_sources",
    "merge_hashes",
    "merge_pieces",
    "metadata_from_pointer",
    "pointer_metadata",
    "preinit_nixl_agent",
    "pull",
    "resolve_nixl_backend_kwargs",
    "scatter_changes",
    "state_blocks_digest",
    "targets_for_policy",
    "tensors_digest",
    "worth_sending",
]
