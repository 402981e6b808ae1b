"""The policy side of one refit: plan, register the source tensors, WRITE bucket by bucket.

No packing copy: each source tensor's own storage is registered with NIXL for the refit,
and a bucket is one WRITE whose descriptors go straight from the tensors into the
receiver's bucket buffer at the planned offsets, moving only the bytes the bucket uses.
The receiver's credit for bucket ``k`` (buffer ``k % B`` is free) gates each WRITE, so
bucket ``k+1`` moves while the receiver's consumer still works on bucket ``k``.  Chunks of a
tensor larger than a bucket go straight into the receiver's reassembly memory when its first
credit offered ``landing`` of the tensor's exact size (see :mod:`.staging`); the bucket
message names them in ``landed``.

Must not import: torch.distributed, the engine module (``nixl.py``), the operator.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .agent import Backoff, NixlAgent, PeerError, RefitTimeoutError
from .base import dtype_name
from .layout import WHOLE, TargetWeightLayout, select_slice
from .mapping import bucket_sender
from .messages import (
    BucketReady,
    BufferDesc,
    Credit,
    Done,
    Landing,
    Manifest,
    ManifestEntry,
    encode,
)
from .planning import Bucket, TensorSpec, check_unique_names, plan_buckets, plan_digest


@dataclass
class Target:
    """A rollout rank this policy rank writes to."""

    rank: int
    agent: str
    buffers: tuple[BufferDesc, ...]
    sources: tuple[int, ...]
    layout: TargetWeightLayout | None
    dev_id: int = 0


@dataclass
class _Stream:
    target: Target
    tensors: dict[str, torch.Tensor]
    buckets: list[Bucket]
    digest: str
    pending: list[tuple[Any, str]] = field(default_factory=list)
    landing: dict[str, Landing] = field(default_factory=dict)


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (host copy for device tensors)."""
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    return zlib.crc32(flat.view(torch.uint8).numpy().tobytes()) if flat.numel() else 0


def prepare_sources(
    weights: Iterable[tuple[str, torch.Tensor]], device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """Materialise the generator: contiguous tensors on ``device``; bad input raises."""
    items: list[tuple[str, torch.Tensor]] = []
    for entry in weights:
        name, tensor = entry
        if not isinstance(name, str) or not name:
            raise ValueError(f"weight names must be non-empty strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor")
        dtype_name(tensor.dtype)
        tensor = tensor.detach()
        if tensor.device.type != device.type:
            tensor = tensor.to(device)
        items.append((name, tensor.contiguous()))
    check_unique_names([name for name, _ in items])
    return items


def _for_target(
    items: Sequence[tuple[str, torch.Tensor]], layout: TargetWeightLayout | None
) -> dict[str, torch.Tensor]:
    chosen: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        part = select_slice(name, tuple(tensor.shape), layout)
        if part is None:
            continue
        whole = part == WHOLE
        chosen[name] = tensor if whole else tensor.narrow(part.dim, part.start, part.length)
        chosen[name] = chosen[name].contiguous()
    return chosen


def _dev(tensor: torch.Tensor) -> int:
    return tensor.device.index or 0 if tensor.device.type == "cuda" else 0


def _regions(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int, int]]:
    # Whole storages, deduplicated: views of one storage must not register overlapping ranges.
    seen: dict[int, tuple[int, int]] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            size = max(seen.get(storage.data_ptr(), (0, 0))[0], storage.nbytes())
            seen[storage.data_ptr()] = (size, _dev(tensor))
    return [(addr, size, dev) for addr, (size, dev) in seen.items()]


class RefitSender:
    """Sends one refit from this policy rank to its targets."""

    def __init__(
        self,
        agent: NixlAgent,
        *,
        rank: int,
        refit: int,
        bucket_size: int,
        mem_type: str,
        timeout_s: float,
        with_checksums: bool,
    ) -> None:
        self.agent, self.rank, self.refit = agent, rank, refit
        self.bucket_size, self.mem_type, self.timeout_s = bucket_size, mem_type, timeout_s
        self.with_checksums = with_checksums

    async def run(
        self, items: Sequence[tuple[str, torch.Tensor]], targets: Sequence[Target]
    ) -> None:
        self.agent.forget_before(self.refit)
        streams = [self._plan(items, target) for target in targets]
        all_tensors = [t for s in streams for t in s.tensors.values()]
        registered = (
            self.agent.register(_regions(all_tensors), self.mem_type)
            if any(t.numel() for t in all_tensors)
            else None
        )
        try:
            await self._stream_all(streams)
        except Exception as exc:
            for stream in streams:
                self.agent.abort(stream.target.agent, self.refit, f"policy rank {self.rank}: {exc}")
            raise
        finally:
            for stream in streams:
                for handle, _ in stream.pending:
                    handle.release()
            if registered is not None:
                self.agent.deregister(registered)

    def _plan(self, items: Sequence[tuple[str, torch.Tensor]], target: Target) -> _Stream:
        tensors = _for_target(items, target.layout)
        specs = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
        buckets = plan_buckets(specs, self.bucket_size)
        return _Stream(target, tensors, buckets, plan_digest(specs, self.bucket_size))

    async def _stream_all(self, streams: list[_Stream]) -> None:
        for stream in streams:
            if stream.target.sources[0] == self.rank:
                self.agent.send_control(
                    stream.target.agent, self._manifest(stream), who=self._who(stream.target)
                )
        longest = max((len(s.buckets) for s in streams), default=0)
        for seq in range(longest):
            for stream in streams:
                if seq < len(stream.buckets) and bucket_sender(seq, stream.target.sources) == (
                    self.rank
                ):
                    await self._send_bucket(stream, seq)
        for stream in streams:
            deadline = time.monotonic() + self.timeout_s
            for handle, what in stream.pending:
                await self.agent.wait_transfer(handle, stream.target.agent, what, deadline)
            stream.pending.clear()
        for stream in streams:
            await self._wait(stream, "done", 0, f"confirmation of refit {self.refit}")

    def _who(self, target: Target) -> str:
        return f"policy rank {self.rank}: rollout rank {target.rank}"

    def _manifest(self, stream: _Stream) -> Manifest:
        entries = tuple(
            ManifestEntry(
                name=name,
                dtype=dtype_name(t.dtype),
                shape=tuple(t.shape),
                checksum=checksum(t) if self.with_checksums else None,
            )
            for name, t in stream.tensors.items()
        )
        return Manifest(
            refit=self.refit,
            total_buckets=len(stream.buckets),
            digest=stream.digest,
            tensors=entries,
        )

    async def _wait(self, stream: _Stream, kind: str, seq: int, what: str) -> Credit | Done:
        """Wait for a control message while keeping this stream's WRITEs progressing."""
        peer = stream.target.agent
        deadline, backoff = time.monotonic() + self.timeout_s, Backoff()
        label = f"{what} from rollout rank {stream.target.rank}"
        while True:
            self._reap(stream)
            found = self.agent.take_control(peer, kind, self.refit, seq)
            if isinstance(found, Credit | Done):
                return found
            if time.monotonic() > deadline:
                raise RefitTimeoutError(
                    f"policy rank {self.rank}: timed out after {self.timeout_s}s waiting for "
                    f"{label} (agent {peer!r})"
                )
            await backoff.sleep()

    def _reap(self, stream: _Stream) -> None:
        still: list[tuple[Any, str]] = []
        for handle, what in stream.pending:
            state = self.agent.transfer_state(handle)
            if state == "ERR":
                raise PeerError(
                    f"policy rank {self.rank}: {what} to rollout rank {stream.target.rank} "
                    f"failed (peer gone?)"
                )
            if state == "DONE":
                handle.release()
            else:
                still.append((handle, what))
        stream.pending = still

    async def _send_bucket(self, stream: _Stream, seq: int) -> None:
        target = stream.target
        buffer = seq % len(target.buffers)
        credit = await self._wait(stream, "credit", seq, f"credit for bucket {seq}")
        if not isinstance(credit, Credit) or credit.buffer != buffer:
            raise PeerError(f"rollout rank {target.rank} offered buffer {credit} for bucket {seq}")
        for offered in credit.landing:
            try:
                self.agent.add_remote_memory(target.agent, offered.metadata)
            except PeerError as exc:
                raise PeerError(f"{self._who(target)}: landing {offered.name!r}: {exc}") from exc
            stream.landing[offered.name] = offered
        pieces = stream.buckets[seq]
        desc = target.buffers[buffer]
        local, remote, landed = [], [], set()
        for piece in pieces:
            if piece.chunk_size == 0:
                continue
            source = stream.tensors[piece.name]
            local.append((source.data_ptr() + piece.chunk_offset, piece.chunk_size, _dev(source)))
            offer = stream.landing.get(piece.name)
            if offer is not None and offer.nbytes == piece.nbytes and not piece.is_whole:
                landed.add(piece.name)
                remote.append((offer.addr + piece.chunk_offset, piece.chunk_size, offer.dev_id))
            else:
                remote.append((desc.addr + piece.offset, piece.chunk_size, target.dev_id))
        message = BucketReady(
            refit=self.refit,
            seq=seq,
            buffer=buffer,
            total_buckets=len(stream.buckets),
            digest=stream.digest,
            pieces=tuple(pieces),
            landed=tuple(sorted(landed)),
        )
        if not local:
            self.agent.send_control(target.agent, message, who=self._who(target))
            return
        try:
            handle = self.agent.post_write(
                target.agent, local, remote, self.mem_type, encode(message)
            )
        except PeerError as exc:
            raise PeerError(f"{self._who(target)}: bucket {seq}: {exc}") from exc
        stream.pending.append((handle, f"bucket {seq} of refit {self.refit}"))


__all__ = ["Done", "RefitSender", "Target", "checksum", "prepare_sources"]
