"""The rollout side of one refit: credit buffers, check every bucket, yield batches.

Order of events for refit ``r`` with ``B`` buffers: the receiver credits buckets
``0..B-1`` (this also tells the senders it is ready), takes the manifest from its first
source, then for each bucket ``k`` waits for the WRITE's notification from
``bucket_sender(k)``, checks every piece against the manifest, and yields the tensors that
are complete.  Whole tensors are views of the bucket buffer, valid until the consumer asks
for the next batch (copy them in the loop body, as upstream); chunks of larger tensors are
reassembled in place.  When the consumer resumes, buffer ``k % B`` is credited for bucket
``k + B``.

Reassembly: with a :class:`~.staging.Staging` (the engine passes one on CPU) each such tensor
is rebuilt in memory kept across refits, valid until the next refit starts; each source's
first credit offers that memory as ``landing``, and chunks the sender WROTE there (named in
the bucket's ``landed``) need no copy.  Without one (CUDA, whose caching allocator already
reuses freed blocks) chunks are copied out of the buffer into fresh memory.

Completeness (missing, extra, duplicate names, dtype/shape mismatch, checksums) is checked
*before the final batch is yielded*: a refit that would end incomplete raises instead of
yielding its last batch, so a caller that stages batches and commits after the loop never
commits a partial refit.

Must not import: torch.distributed, the engine module (``nixl.py``), the operator.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import torch

from .agent import NixlAgent
from .base import TensorMeta, dtype_from_name
from .mapping import bucket_sender
from .messages import BucketReady, Credit, Done, Landing, Manifest, ManifestEntry
from .planning import check_unique_names
from .sender import checksum
from .staging import Staging


class IncompleteRefitError(RuntimeError):
    """The received refit does not match its manifest."""


@dataclass
class Source:
    """A policy rank that writes to this rollout rank."""

    rank: int
    agent: str


class RefitReceiver:
    """Receives one refit into this rank's bucket buffers."""

    def __init__(
        self,
        agent: NixlAgent,
        *,
        rank: int,
        refit: int,
        buffers: Sequence[torch.Tensor],
        sources: Sequence[Source],
        timeout_s: float,
        staging: Staging | None = None,
    ) -> None:
        self.agent, self.rank, self.refit = agent, rank, refit
        self.buffers, self.sources, self.timeout_s = list(buffers), list(sources), timeout_s
        self.staging = staging
        self._landing: tuple[Landing, ...] = staging.offers() if staging else ()
        self._offered = {offer.name: offer.nbytes for offer in self._landing}
        self._credited: set[int] = set()
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}
        self._complete: set[str] = set()
        self._staged: set[str] = set()

    def _sender(self, seq: int) -> Source:
        ranks = tuple(range(len(self.sources)))
        return self.sources[bucket_sender(seq, ranks)]

    async def run(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        self.agent.forget_before(self.refit)
        try:
            for seq in range(len(self.buffers)):
                self._credit(seq)
            manifest = await self._wait(self.sources[0], "manifest", 0, "the manifest")
            if not isinstance(manifest, Manifest):
                raise IncompleteRefitError(f"expected a manifest, got {manifest}")
            entries = self._check_manifest(manifest)
            for seq in range(manifest.total_buckets):
                batch, last = await self._bucket(seq, manifest, entries)
                if last:
                    self._check_complete(entries)
                    if self.staging is not None:
                        # Renamed, resized or dropped tensors must not pin their memory.
                        self.staging.keep_only(self._staged)
                    for source in self.sources:
                        self.agent.send_control(
                            source.agent,
                            Done(refit=self.refit),
                            who=f"rollout rank {self.rank}: policy rank {source.rank}",
                        )
                    self.agent.poll()  # one progress call: usually enough to send it
                if batch:
                    yield batch
                if seq + len(self.buffers) < manifest.total_buckets:
                    self._credit(seq + len(self.buffers))
            self.agent.poll()  # progress once more so "done" leaves; finalize() flushes
        except Exception as exc:
            for source in self.sources:
                self.agent.abort(source.agent, self.refit, f"rollout rank {self.rank}: {exc}")
            raise

    def _credit(self, seq: int) -> None:
        buffer = seq % len(self.buffers)
        source = self._sender(seq)
        landing = () if source.rank in self._credited else self._landing
        self._credited.add(source.rank)
        self.agent.send_control(
            source.agent,
            Credit(refit=self.refit, seq=seq, buffer=buffer, landing=landing),
            who=f"rollout rank {self.rank}: policy rank {source.rank}",
        )

    async def _wait(self, source: Source, kind: str, seq: int, what: str) -> object:
        deadline = time.monotonic() + self.timeout_s
        return await self.agent.wait_control(
            source.agent,
            kind,
            self.refit,
            seq,
            what=f"rollout rank {self.rank}: {what} of refit {self.refit} "
            f"(policy rank {source.rank}, within {self.timeout_s}s)",
            deadline=deadline,
        )

    def _check_manifest(self, manifest: Manifest) -> dict[str, ManifestEntry]:
        check_unique_names([entry.name for entry in manifest.tensors])
        for entry in manifest.tensors:
            dtype_from_name(entry.dtype)
        return {entry.name: entry for entry in manifest.tensors}

    async def _bucket(
        self, seq: int, manifest: Manifest, entries: dict[str, ManifestEntry]
    ) -> tuple[list[tuple[str, torch.Tensor]], bool]:
        source = self._sender(seq)
        message = await self._wait(source, "bucket", seq, f"bucket {seq}")
        if not isinstance(message, BucketReady):
            raise IncompleteRefitError(f"expected bucket {seq}, got {message}")
        if (message.total_buckets, message.digest) != (manifest.total_buckets, manifest.digest):
            raise IncompleteRefitError(
                f"policy rank {source.rank} planned {message.total_buckets} buckets "
                f"(digest {message.digest}), the manifest {manifest.total_buckets} "
                f"(digest {manifest.digest}): striping senders disagree on the weights"
            )
        if message.buffer != seq % len(self.buffers):
            raise IncompleteRefitError(f"bucket {seq} landed in buffer {message.buffer}")
        buffer = self.buffers[message.buffer]
        if buffer.device.type == "cuda":
            torch.cuda.synchronize(buffer.device)
        landed = set(message.landed)
        batch = [self._piece(p, entries, buffer, p.name in landed) for p in message.pieces]
        return [item for item in batch if item is not None], seq == manifest.total_buckets - 1

    def _piece(
        self,
        piece: TensorMeta,
        entries: dict[str, ManifestEntry],
        buffer: torch.Tensor,
        landed: bool,
    ) -> tuple[str, torch.Tensor] | None:
        entry = entries.get(piece.name)
        if entry is None:
            raise IncompleteRefitError(f"tensor {piece.name!r} is not in the manifest")
        if (entry.dtype, entry.shape) != (piece.dtype, piece.shape):
            raise IncompleteRefitError(
                f"tensor {piece.name!r}: bucket says {piece.dtype}{list(piece.shape)}, "
                f"manifest says {entry.dtype}{list(entry.shape)}"
            )
        if piece.name in self._complete:
            raise IncompleteRefitError(f"tensor {piece.name!r} arrived twice")
        end = piece.chunk_offset + piece.chunk_size
        if end > piece.nbytes or piece.offset + piece.chunk_size > buffer.numel():
            raise IncompleteRefitError(f"piece {piece} lies outside its tensor or buffer")
        if landed and self._offered.get(piece.name) != piece.nbytes:
            raise IncompleteRefitError(
                f"tensor {piece.name!r} landed in memory this rank did not offer for it"
            )
        dtype = dtype_from_name(piece.dtype)
        data = buffer[piece.offset : piece.offset + piece.chunk_size]
        if piece.is_whole and not landed:
            tensor = (
                data.view(dtype).view(piece.shape)
                if piece.nbytes
                else torch.empty(piece.shape, dtype=dtype, device=buffer.device)
            )
            return self._finish(entry, tensor)
        whole, filled = self._partial.get(piece.name) or (self._stage(piece, buffer.device), 0)
        if piece.chunk_offset != filled:
            raise IncompleteRefitError(
                f"tensor {piece.name!r}: chunk at byte {piece.chunk_offset} arrived, "
                f"expected byte {filled}"
            )
        if not landed:
            whole[piece.chunk_offset : end].copy_(data)
        if end < piece.nbytes:
            self._partial[piece.name] = (whole, end)
            return None
        self._partial.pop(piece.name, None)
        return self._finish(entry, whole.view(dtype).view(piece.shape))

    def _stage(self, piece: TensorMeta, device: torch.device) -> torch.Tensor:
        """Memory to reassemble ``piece``'s tensor in (kept across refits when staging)."""
        if self.staging is None:
            return torch.empty(piece.nbytes, dtype=torch.uint8, device=device)
        self._staged.add(piece.name)
        return self.staging.get(piece.name, piece.nbytes, device)

    def _finish(self, entry: ManifestEntry, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        if entry.checksum is not None and checksum(tensor) != entry.checksum:
            raise IncompleteRefitError(f"tensor {entry.name!r} failed its checksum")
        self._complete.add(entry.name)
        return entry.name, tensor

    def _check_complete(self, entries: dict[str, ManifestEntry]) -> None:
        missing = sorted(set(entries) - self._complete)
        if missing:
            shown = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
            raise IncompleteRefitError(
                f"rollout rank {self.rank}: refit {self.refit} ended without "
                f"{len(missing)} tensor(s): {shown}"
            )
