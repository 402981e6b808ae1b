"""The engine-neutral contract: :class:`CheckpointEngine`, :class:`TensorMeta` and dtypes.

A checkpoint engine moves a model's named tensors from policy ranks to rollout ranks.
``TensorMeta`` describes one piece of one tensor inside a transfer bucket (a whole tensor,
or a chunk of one larger than a bucket).  Dtypes travel by name; only the names in
:data:`WIRE_DTYPES` are accepted, so a message cannot make the receiver build anything else.
"""

from __future__ import annotations

import abc
import math
from collections.abc import AsyncGenerator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from refit_worker.contract.dtypes import WIRE_DTYPE_NAMES

#: dtype name on the wire -> torch dtype: the worker's one dtype registry.  The names are
#: the contract's (``refit_worker.contract.dtypes``), torch's own attribute names; a dtype
#: this torch build lacks (older fp8 types) is left out.
WIRE_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in WIRE_DTYPE_NAMES if hasattr(torch, name)
}
_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; ``ValueError`` for a dtype the wire does not carry."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} cannot be transferred; supported: {sorted(WIRE_DTYPES)}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for wire name ``name``; ``ValueError`` for an unknown name."""
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; supported: {sorted(WIRE_DTYPES)}") from None


_ITEMSIZE = {
    name: torch.empty((), dtype=dtype).element_size() for name, dtype in WIRE_DTYPES.items()
}


#: The integer dtype of each element width, to compare or rotate elements as their bits.
SAME_WIDTH_INT: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}


def element_size(name: str) -> int:
    """Bytes per element of the wire dtype ``name``."""
    if name not in _ITEMSIZE:
        dtype_from_name(name)  # raises, naming the bad value
    return _ITEMSIZE[name]


class TensorMeta(BaseModel):
    """One piece of a tensor inside a bucket.

    ``chunk_offset`` and ``chunk_size`` are byte positions inside the tensor; ``offset`` is the
    byte position inside the bucket.  A tensor that fits in a bucket has one piece with
    ``chunk_offset == 0`` and ``chunk_size == nbytes``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    shape: tuple[int, ...]
    dtype: str
    chunk_offset: int = Field(ge=0)
    chunk_size: int = Field(ge=0)
    offset: int = Field(ge=0)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor (not just this piece)."""
        return math.prod(self.shape) * element_size(self.dtype)

    @property
    def is_whole(self) -> bool:
        """Whether this piece is the entire tensor."""
        return self.chunk_offset == 0 and self.chunk_size == self.nbytes


@dataclass(frozen=True)
class RefitTiming:
    """What one refit cost on this rank, as measured by the engine.

    ``seconds`` runs from the moment the transfer could start (a receiver: it told its
    senders ``ready``; a sender: every target was ready) to the moment the refit was
    complete and verified (a receiver: before it confirms ``done``; a sender: every
    ``done`` arrived), so it leaves out waiting for the peer to begin.  ``control_s`` is the
    control work of the refit (checks, planning, allocating and registering memory, route
    set-up), on a receiver all of it before ``ready``, on a sender partly inside
    ``seconds`` (route set-up once the targets are ready).
    """

    refit_id: int
    role: str
    bytes: int
    seconds: float
    control_s: float
    #: NIXL registrations made in this refit (0 once they are reused).
    registrations: int
    #: Sets of prepared WRITE handles built in this refit (0 once they are reused).
    routes_built: int = 0
    #: A policy rank: the rollout ranks that confirmed this refit, in order.
    delivered: tuple[int, ...] = ()
    #: A policy rank: the targets taken out of this refit (failed, declined, dropped by the
    #: caller), each with its reason; they did not receive it.
    dropped: Mapping[int, str] = field(default_factory=dict)
    #: A policy rank: the dropped targets that declined a delta and want the refit whole.
    wants_whole: frozenset[int] = frozenset()
    #: A rollout rank: the hash every byte of this refit was checked with (None: the bytes
    #: were not hashed, only the manifest checked).  What a report may claim comes from
    #: here, not from the configuration.
    integrity: str | None = None
    #: A rollout rank: the fingerprint of the job key whose seals every source's manifest
    #: and hashes passed (None: no signature was checked).
    signed_by: str | None = None
    #: A rollout rank: those seals (:class:`~.messages.signing.SealRecord`), for the peers it seeds.
    seals: tuple[Any, ...] = ()
    #: Seconds of ``control_s`` spent signing (policy) or verifying (rollout) seals.
    seal_s: float = 0.0
    #: A rollout rank: the landed tensors' hashes it computed while checking the refit
    #: (:class:`~.messages.known_hashes.KnownHash`), so its commit is not hashed twice.
    known_hashes: Mapping[str, Any] = field(default_factory=dict)


class CheckpointEngine(abc.ABC):
    """Moves named tensors from policy ranks to rollout ranks.

    Flow on every rank: ``prepare()`` returns this rank's metadata; the caller exchanges the
    metadata of all ranks out of band and calls ``init_policy_process_group`` or
    ``init_rollout_process_group``; then policy ranks ``await send_weights(...)`` while
    rollout ranks iterate ``receive_weight_batches()``; ``finalize()`` tears down.
    """

    @abc.abstractmethod
    def prepare(self) -> Any:
        """Allocate transfer resources; return this rank's metadata for its peers."""

    @abc.abstractmethod
    def init_policy_process_group(
        self, *, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: Any
    ) -> None:
        """Connect a policy (sending) rank to its rollout peers."""

    @abc.abstractmethod
    def init_rollout_process_group(
        self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: Any
    ) -> None:
        """Connect a rollout (receiving) rank to its policy peers."""

    @abc.abstractmethod
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> RefitTiming | None:
        """Send every named tensor of ``weights`` to this rank's rollout peers; return what
        the refit cost when the engine measures it."""

    @abc.abstractmethod
    def receive_weight_batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        """Yield batches of received named tensors until the refit is complete."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Disconnect from peers and free transfer resources."""

    def get_target_weight_layout(self) -> dict[str, Any] | None:
        """The weights this rank wants (experts, tensor-parallel slices); ``None``: all."""
        return None
