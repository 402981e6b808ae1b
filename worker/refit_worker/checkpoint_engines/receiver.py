"""The rollout side of one refit: credit buffers, check every bucket, yield batches.

Order of events for refit ``r`` with ``B`` buffers: the receiver credits buckets
``0..B-1`` (this also tells the senders it is ready), takes the manifest from its first
source, then for each bucket ``k`` waits for the WRITE's notification from
``bucket_sender(k)``, checks every piece against the manifest, and yields the tensors that
are complete.  Whole tensors are views of the bucket buffer, valid until the consumer asks
for the next batch (copy them in the loop body, as upstream); chunks of larger tensors are
reassembled into staging memory.  When the consumer resumes, buffer ``k % B`` is credited for
bucket ``k + B``.

Staging: given a ``staging`` dict (the engine passes one on CPU), a reassembled tensor's
memory is kept per name and reused by the next refit, so it is valid only until the next
refit starts.  First-touching ~100 MiB of fresh pages every refit cost more than copying the
chunks into them (measured: ~15% of a 1 GiB refit at 64 MiB buckets); on CUDA the caching
allocator already reuses freed blocks, so there the engine passes none.

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
from .messages import BucketReady, Credit, Done, Manifest, ManifestEntry
from .planning import check_unique_names
from .sender import checksum


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
        self, agent: NixlAgent, *, rank: int, refit: int, buffers: Sequence[torch.Tensor],
        sources: Sequence[Source], timeout_s: float,
        staging: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.agent, self.rank, self.refit = agent, rank, refit
        self.buffers, self.sources, self.timeout_s = list(buffers), list(sources), timeout_s
        self.staging = staging
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
                    self._prune_staging()
                    for source in self.sources:
                        self.agent.send_control(
                            source.agent, Done(refit=self.refit),
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
        self.agent.send_control(
            source.agent, Credit(refit=self.refit, seq=seq, buffer=buffer),
            who=f"rollout rank {self.rank}: policy rank {source.rank}",
        )

    async def _wait(self, source: Source, kind: str, seq: int, what: str) -> object:
        deadline = time.monotonic() + self.timeout_s
        return await self.agent.wait_control(
            source.agent, kind, self.refit, seq,
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
        batch = [self._piece(piece, entries, buffer) for piece in message.pieces]
        return [item for item in batch if item is not None], seq == manifest.total_buckets - 1

    def _piece(
        self, piece: TensorMeta, entries: dict[str, ManifestEntry], buffer: torch.Tensor
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
        dtype = dtype_from_name(piece.dtype)
        data = buffer[piece.offset : piece.offset + piece.chunk_size]
        if piece.is_whole:
            tensor = data.view(dtype).view(piece.shape) if piece.nbytes else torch.empty(
                piece.shape, dtype=dtype, device=buffer.device)
            return self._finish(entry, tensor)
        whole, filled = self._partial.get(piece.name) or (self._stage(piece, buffer.device), 0)
        if piece.chunk_offset != filled:
            raise IncompleteRefitError(
                f"tensor {piece.name!r}: chunk at byte {piece.chunk_offset} arrived, "
                f"expected byte {filled}"
            )
        whole[piece.chunk_offset : end].copy_(data)
        if end < piece.nbytes:
            self._partial[piece.name] = (whole, end)
            return None
        self._partial.pop(piece.name, None)
        return self._finish(entry, whole.view(dtype).view(piece.shape))

    def _stage(self, piece: TensorMeta, device: torch.device) -> torch.Tensor:
        """Memory to reassemble ``piece``'s tensor in: last refit's when it still fits."""
        kept = self.staging.get(piece.name) if self.staging is not None else None
        if kept is None or kept.numel() != piece.nbytes or kept.device != device:
            kept = torch.empty(piece.nbytes, dtype=torch.uint8, device=device)
        if self.staging is not None:
            self.staging[piece.name] = kept
            self._staged.add(piece.name)
        return kept

    def _prune_staging(self) -> None:
        # Tensors that were renamed, resized away or dropped must not pin their memory.
        if self.staging is not None:
            for name in set(self.staging) - self._staged:
                del self.staging[name]

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
