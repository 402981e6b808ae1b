"""The policy side of one refit: plan, WRITE bucket by bucket, hash beside the transfer.

No packing copy: each source tensor's storage is registered with NIXL (once, see
:mod:`refit_worker.engine.transport.registry`), and a bucket is one WRITE whose descriptors go
straight from the tensors into the receiver's memory, moving only the bytes the bucket uses.  The
receiver answers the manifest with ``ready``, naming the memory the tensors land in (its final
tensors, or its reassembly memory for tensors larger than a bucket); a piece goes there when its
tensor has landing memory of its exact size, else into the receive buffer the plan assigns its
bucket. Only buckets that use a buffer wait for a credit, so a refit that lands everything streams
its buckets back to back without waiting for anyone.

Per target, the descriptor lists and one WRITE handle per bucket are prepared once and
reposted refit after refit with the new notification (:class:`~.routes.Routes`), for as long as the
plan, the source addresses and the landing memory stay the same.

A sharded refit (:meth:`RefitSender.plan_sharded`) writes only this rank's pieces of the
global plan, each from its offset in the local shard
(:func:`~refit_worker.engine.planning.shard_plan.source_offset`).

A target that fails (its WRITEs go to ERR, a wait on it times out, it aborts or
declines) or that the caller drops is taken out of the refit alone (:mod:`.delivery`): the
others complete, and the refit reports which targets confirmed and why the others did not.

With integrity on, a pool thread hashes each bucket's source bytes while the transfer runs
(:mod:`refit_worker.engine.messages.integrity`); digests follow the buckets as they are ready.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from refit_worker.contract.waits import apoll_until, precise_sleep

from ..base import dtype_name
from ..messages.integrity import Algorithm, Hasher, as_bytes
from ..messages.signing import RefitSigner, seal_payload
from ..messages.wire import (
    BucketReady,
    Credit,
    DeltaHeader,
    Digest,
    Done,
    LandingSet,
    Manifest,
    ManifestEntry,
    Ready,
    Seal,
    SourceBox,
    encode,
)
from ..planning.buckets import Plan, TensorSpec, buffer_slots, cached_plan, lands
from ..planning.shard_plan import (
    Holding,
    ShardSpec,
    cached_shard_plan,
    receiver_specs,
    source_offset,
)
from ..transport.agent import (
    IDLE_BACKOFF,
    REFIT_BACKOFF,
    NixlAgent,
    PeerError,
    PreparedWrites,
    RefitTimeoutError,
)
from ..transport.peers import Target
from ..transport.registry import MemoryRegistry, device_id
from .routes import Routes
from .sources import for_target, prepare_sources
from .target_failures import Delivery

Region = tuple[int, int, int]


@dataclass
class TargetStream:
    """What one refit sends one target: its tensors, their bucket plan, this rank's buckets."""

    target: Target
    routes: Routes
    tensors: dict[str, torch.Tensor]
    plan: Plan
    seqs: list[int] = field(default_factory=list)  # buckets this rank sends, in order
    slots: list[int] = field(default_factory=list)
    prepared: PreparedWrites | None = None
    inflight: list[int] = field(default_factory=list)  # posted, not seen DONE yet
    hashes: dict[int, Future[tuple[int, ...]]] = field(default_factory=dict)
    #: What this refit told the target, for its seal: the manifest last sent, the digests.
    manifest: Manifest | None = None
    sent: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def handle(self, seq: int) -> Any:
        """The prepared WRITE of bucket ``seq`` (None: the bucket has no bytes)."""
        if self.prepared is None:
            raise RuntimeError("the stream's WRITEs are not prepared yet")
        return self.prepared.handles[self.position[seq]]

    def __post_init__(self) -> None:
        self.position = {seq: i for i, seq in enumerate(self.seqs)}

    @property
    def nbytes(self) -> int:
        """The refit's bytes for this target: a sharded plan's pieces this rank sends, else
        every tensor (striping senders each count the whole model, as before)."""
        if self.plan.senders is not None:
            return sum(p.chunk_size for seq in self.seqs for p in self.plan.buckets[seq])
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


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
        registry: MemoryRegistry,
        routes: dict[str, Routes],
        hasher: Hasher | None,
        integrity: Algorithm | None,
        version: int = 0,
        rollout_world_size: int | None = None,
        delta: DeltaHeader | None = None,
        signer: RefitSigner | None = None,
    ) -> None:
        self.agent, self.rank, self.refit = agent, rank, refit
        #: Seals every target's manifest and digests (None: the refit goes unsigned).
        self.signer = signer
        #: This refit is a delta onto the version the header names (None: whole).
        self.delta = delta
        self.version, self.rollout_world_size = version, rollout_world_size
        #: Targets taken out of this refit, with their reasons.
        self.delivery = Delivery()
        self._settled: set[int] = set()
        self.bucket_size, self.mem_type, self.timeout_s = bucket_size, mem_type, timeout_s
        self.registry, self.routes = registry, routes
        self.hasher, self.integrity = hasher, integrity
        #: Seconds of control work (plan, registration, route set-up) in this refit.
        self.control_s = 0.0
        #: Of which signing the seals.
        self.sign_s = 0.0
        #: When every target was ready, and when every target confirmed (monotonic).
        self.started_at = self.ended_at = 0.0
        self._streams: list[TargetStream] = []

    def plan(
        self, items: Sequence[tuple[str, torch.Tensor]], targets: Sequence[Target]
    ) -> list[TargetStream]:
        """Per target: its tensors and (cached) plan; registers the sources."""
        t0 = time.perf_counter()
        streams = []
        for target in targets:
            tensors = for_target(items, target.layout)
            specs = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
            plan = cached_plan(specs, self.bucket_size)
            seqs = [
                seq
                for seq in range(len(plan.buckets))
                if plan.sender(seq, target.sources) == self.rank
            ]
            routes = self.routes.setdefault(target.agent, Routes())
            streams.append(TargetStream(target, routes, tensors, plan, seqs))
        self._register(streams, t0)
        return streams

    def plan_sharded(
        self,
        held: Sequence[Holding],
        local: Mapping[str, torch.Tensor],
        targets: Sequence[Target],
    ) -> list[TargetStream]:
        """Per target: the global plan of the sharded refit and this rank's buckets of it
        (``local``: this rank's block of each weight).

        A target gets a stream when this rank sends it a bucket or its manifest."""
        t0 = time.perf_counter()
        streams = []
        for target in targets:
            plan = cached_shard_plan(
                receiver_specs(held, target.rank, target.layout), self.bucket_size
            )
            seqs = [seq for seq in range(len(plan.buckets)) if plan.sender(seq, ()) == self.rank]
            if not seqs and target.sources[0] != self.rank:
                continue
            names = {piece.name for seq in seqs for piece in plan.buckets[seq]}
            tensors = {name: local[name] for name in local if name in names}
            routes = self.routes.setdefault(target.agent, Routes())
            streams.append(TargetStream(target, routes, tensors, plan, seqs))
        self._register(streams, t0)
        return streams

    def _register(self, streams: list[TargetStream], t0: float) -> None:
        self.registry.next_refit()
        self.registry.ensure(t for s in streams for t in s.tensors.values())
        self.registry.sweep(keep=1)
        self.control_s += time.perf_counter() - t0

    async def run(self, streams: list[TargetStream], ready: torch.cuda.Event | None) -> None:
        self.agent.forget_before(self.refit)
        self._streams = streams
        try:
            self._start_hashes(streams, ready)
            await self._stream_all(streams)
        except BaseException as exc:
            for stream in streams:
                # In-flight handles must not be reposted: forget this target's prepared WRITEs
                # (its landing sets stay known: the receiver names them by id from now on).
                stream.routes.forget_prepared()
                for future in stream.hashes.values():
                    future.cancel()
                self.agent.abort(stream.target.agent, self.refit, f"policy rank {self.rank}: {exc}")
            raise

    def drop(self, rank: int, reason: str) -> None:
        """Stop waiting for target ``rank`` in this refit (it no longer counts)."""
        self.delivery.drop(rank, reason)

    def _live(self, streams: Sequence[TargetStream]) -> list[TargetStream]:
        self._settle()
        return [s for s in streams if self.delivery.live(s.target.rank)]

    def _settle(self) -> None:
        """Release what a dropped target's stream holds; tell the target (best effort)."""
        for stream in self._streams:
            rank = stream.target.rank
            if self.delivery.live(rank) or rank in self._settled:
                continue
            self._settled.add(rank)
            # Its in-flight handles must not be reposted; its landing sets stay known.
            stream.routes.forget_prepared()
            stream.inflight = []
            # Fan-out shares a bucket's hash between targets: only a hash no live target
            # still waits for may be cancelled.
            kept = {
                id(f)
                for other in self._streams
                if self.delivery.live(other.target.rank)
                for f in other.hashes.values()
            }
            for future in stream.hashes.values():
                if id(future) not in kept:
                    future.cancel()
            stream.hashes.clear()
            if rank in self.delivery.wants_whole:
                continue  # it stopped this send itself and waits for the refit whole
            self.agent.abort(
                stream.target.agent,
                self.refit,
                f"policy rank {self.rank} dropped it: {self.delivery.dropped[rank]}",
            )

    def _start_hashes(self, streams: list[TargetStream], ready: torch.cuda.Event | None) -> None:
        if self.hasher is None or self.integrity is None:
            return
        # Fan-out sends the same bytes to several targets: hash each bucket once.
        shared: dict[tuple[Any, ...], Future[tuple[int, ...]]] = {}
        for stream in streams:
            for seq in stream.seqs:
                bucket = stream.plan.buckets[seq]
                sources = [stream.tensors[p.name] for p in bucket]
                key = (stream.plan.digest, seq, tuple(t.data_ptr() for t in sources))
                if key not in shared:
                    views = [
                        as_bytes(t)[source_offset(p) : source_offset(p) + p.chunk_size]
                        for t, p in zip(sources, bucket, strict=True)
                    ]
                    shared[key] = self.hasher.submit(views, self.integrity, ready)
                stream.hashes[seq] = shared[key]

    async def _stream_all(self, streams: list[TargetStream]) -> None:
        d = self.delivery
        for stream in streams:  # every source sends one: the receiver compares them
            d.attempt_now(stream.target.rank, partial(self._send_manifest, stream))
        for stream in self._live(streams):
            await d.attempt(stream.target.rank, self._ready(stream))
        self.started_at = time.monotonic()
        longest = max((len(s.seqs) for s in streams), default=0)
        for turn in range(longest):
            for stream in self._live(streams):
                if turn < len(stream.seqs):
                    rank = stream.target.rank
                    await d.attempt(rank, self._send_bucket(stream, stream.seqs[turn]))
                    self._progress()
                    d.attempt_now(rank, partial(self._send_digests, stream, block=False))
        await self._writes_done(streams)
        for stream in self._live(streams):
            for seq in sorted(stream.hashes):
                await asyncio.wrap_future(stream.hashes[seq])
            d.attempt_now(stream.target.rank, partial(self._send_digests, stream, block=True))
            d.attempt_now(stream.target.rank, partial(self._send_seal, stream))
        for stream in self._live(streams):
            await d.attempt(
                stream.target.rank,
                self._wait(stream, "done", 0, f"confirmation of refit {self.refit}"),
            )
        self._settle()
        self.ended_at = time.monotonic()

    async def _writes_done(self, streams: list[TargetStream]) -> None:
        """Wait for every posted WRITE; a target whose WRITEs do not finish is dropped."""
        try:
            await apoll_until(
                self._progress,
                timeout=self.timeout_s,
                what=f"policy rank {self.rank}: the WRITEs of refit {self.refit} to complete",
                backoff=REFIT_BACKOFF,
                error=RefitTimeoutError,
                sleep=precise_sleep,
            )
        except RefitTimeoutError as exc:
            for stream in self._live(streams):
                if stream.inflight:
                    self.delivery.drop(stream.target.rank, f"RefitTimeoutError: {exc}")
            self._settle()

    def _send_manifest(self, stream: TargetStream) -> None:
        # A new send of this refit (the whole refit after a declined delta) gets a new
        # answer: the decline of the last one must not stand for it.
        self.agent.discard(stream.target.agent, "decline", self.refit)
        stream.manifest, stream.sent = self._manifest(stream), {}
        self.agent.send_control(stream.target.agent, stream.manifest, who=self._who(stream.target))

    def _who(self, target: Target) -> str:
        return f"policy rank {self.rank}: rollout rank {target.rank}"

    def _manifest(self, stream: TargetStream) -> Manifest:
        """The manifest: built once per (plan, integrity), restamped with the refit id."""
        key = (stream.plan.digest, self.integrity)
        cached = stream.routes.manifests.get(key)
        if cached is None:
            cached = Manifest(
                refit=self.refit,
                version=self.version,
                rollout_world_size=self.rollout_world_size,
                total_buckets=len(stream.plan.buckets),
                digest=stream.plan.digest,
                bucket_size=self.bucket_size,
                integrity=self.integrity,
                tensors=tuple(_entry(spec) for spec in stream.plan.specs),
            )
            stream.routes.manifests = {key: cached}
        return cached.model_copy(
            update={
                "refit": self.refit,
                "version": self.version,
                "rollout_world_size": self.rollout_world_size,
                "connection": stream.routes.connection,
                "delta": self.delta,
                "sealed_by": self.signer.fingerprint if self.signer else None,
            }
        )

    async def _wait(self, stream: TargetStream, kind: str, seq: int, what: str) -> Any:
        """Wait for a control message, driving this refit's WRITEs meanwhile.

        Without NIXL's progress thread a posted WRITE advances only when someone asks for
        its state (UCX's rendezvous needs both sides to progress), so every wait does.
        """
        peer = stream.target.agent

        def arrived() -> Any:
            self._progress()
            self.delivery.check(stream.target.rank)
            return self.agent.take_control(peer, kind, self.refit, seq)

        return await apoll_until(
            arrived,
            timeout=self.timeout_s,
            what=f"policy rank {self.rank}: {what} from rollout rank {stream.target.rank} "
            f"(agent {peer!r})",
            backoff=IDLE_BACKOFF if kind == "ready" else REFIT_BACKOFF,
            error=RefitTimeoutError,
            sleep=precise_sleep,
        )

    def _progress(self) -> bool:
        """Check every WRITE in flight (which drives it); True once none is left.

        A target whose WRITE fails is dropped from the refit, not raised for."""
        for stream in self._streams:
            if not self.delivery.live(stream.target.rank):
                continue
            still: list[int] = []
            for seq in stream.inflight:
                try:
                    state = self.agent.transfer_state(stream.handle(seq))
                except Exception as exc:  # a peer that died: nixl raises instead of "ERR"
                    state, error = "ERR", f": {type(exc).__name__}: {exc}"
                else:
                    error = " (peer gone?)"
                if state == "ERR":
                    self.delivery.drop(
                        stream.target.rank,
                        f"PeerError: {self._who(stream.target)}: bucket {seq} of refit "
                        f"{self.refit} failed{error}",
                    )
                    still = []
                    break
                if state != "DONE":
                    still.append(seq)
            stream.inflight = still
        return not any(
            stream.inflight for stream in self._streams if self.delivery.live(stream.target.rank)
        )

    async def _ready(self, stream: TargetStream) -> None:
        """Wait for the target's ``ready``; load its landing memory; prepare the WRITEs."""
        found = await self._wait(stream, "ready", 0, f"readiness for refit {self.refit}")
        if not isinstance(found, Ready):
            raise PeerError(f"{self._who(stream.target)}: expected ready, got {found}")
        t0 = time.perf_counter()
        landing = self._landing(stream, found)
        sizes = {t.name: t.nbytes for t in landing.tensors} if landing else {}
        stream.slots = buffer_slots(stream.plan.buckets, sizes, len(stream.target.buffers))
        key = (
            stream.plan.digest,
            tuple(t.data_ptr() for t in stream.tensors.values()),
            # A handle prepared over a registration that was since dropped must not be reused.
            self.registry.serials(stream.tensors.values()),
            landing.id if landing else None,
            stream.target.buffers,
            tuple(stream.seqs),
        )
        stream.prepared = stream.routes.get(key)
        if stream.prepared is None:
            stream.prepared = self._prepare(stream, landing, sizes)
            stream.routes.put(key, stream.prepared)
        self.control_s += time.perf_counter() - t0

    def _landing(self, stream: TargetStream, ready: Ready) -> LandingSet | None:
        routes, target = stream.routes, stream.target
        if ready.landing is not None:
            landing = routes.landing.setdefault(ready.landing.id, ready.landing)
        elif ready.landing_id is None:
            return None
        else:
            known = routes.landing.get(ready.landing_id)
            if known is None:
                raise PeerError(
                    f"{self._who(target)}: ready names landing set {ready.landing_id!r}, "
                    "which it never sent on this connection"
                )
            landing = known
        if landing.id not in routes.loaded:
            self._load(stream, landing)
        return landing

    def _load(self, stream: TargetStream, landing: LandingSet) -> None:
        """Load the NIXL metadata of ``landing``; first forget the peer's memory loaded so far
        when some of it was deregistered since (see :meth:`Routes.stale`)."""
        routes, target = stream.routes, stream.target
        try:
            if routes.stale(landing) and target.metadata is not None:
                # Prepared WRITEs name the regions about to be dropped: release them first.
                routes.forget_remote()
                self.agent.reload_remote_agent(target.metadata)
            if landing.metadata:
                self.agent.add_remote_memory(target.agent, landing.metadata)
        except PeerError as exc:
            raise PeerError(f"{self._who(target)}: landing memory: {exc}") from exc
        routes.loaded_now(landing)

    def _prepare(
        self, stream: TargetStream, landing: LandingSet | None, sizes: dict[str, int]
    ) -> PreparedWrites:
        where = {t.name: t for t in landing.tensors} if landing else {}
        local: list[Region] = []
        remote: list[Region] = []
        groups: list[list[int]] = []
        for seq in stream.seqs:
            group = []
            slot = stream.slots[seq]
            for piece in stream.plan.buckets[seq]:
                if piece.chunk_size == 0:
                    continue
                source = stream.tensors[piece.name]
                group.append(len(local))
                local.append(
                    (source.data_ptr() + source_offset(piece), piece.chunk_size, device_id(source))
                )
                if lands(piece, sizes):
                    dest = where[piece.name]
                    remote.append((dest.addr + piece.chunk_offset, piece.chunk_size, dest.dev_id))
                else:
                    desc = stream.target.buffers[slot]
                    remote.append((desc.addr + piece.offset, piece.chunk_size, desc.dev_id))
            groups.append(group)
        return self.agent.prepare_writes(stream.target.agent, local, remote, self.mem_type, groups)

    async def _send_bucket(self, stream: TargetStream, seq: int) -> None:
        self.delivery.check(stream.target.rank)  # dropped meanwhile: its handles are gone
        target, slot = stream.target, stream.slots[seq]
        if slot >= 0:
            credit = await self._wait(stream, "credit", seq, f"credit for bucket {seq}")
            if not isinstance(credit, Credit) or credit.buffer != slot:
                raise PeerError(f"rollout rank {target.rank} offered {credit} for bucket {seq}")
        message = encode(
            BucketReady(refit=self.refit, seq=seq, buffer=slot, digest=stream.plan.digest)
        )
        handle = stream.handle(seq)
        if handle is None:
            self.agent.send_control(
                target.agent,
                BucketReady(refit=self.refit, seq=seq, buffer=slot, digest=stream.plan.digest),
                who=self._who(target),
            )
            return
        try:
            self.agent.post_prepared(handle, target.agent, message)
        except PeerError as exc:
            raise PeerError(f"{self._who(target)}: bucket {seq}: {exc}") from exc
        stream.inflight.append(seq)

    def _send_digests(self, stream: TargetStream, *, block: bool) -> None:
        """Send the digests of finished hashes, in bucket order."""
        self.delivery.check(stream.target.rank)
        for seq in sorted(stream.hashes):
            future = stream.hashes[seq]
            if not (block or future.done()):
                return
            hashes = future.result()
            self.agent.send_control(
                stream.target.agent,
                Digest(refit=self.refit, seq=seq, hashes=hashes),
                who=self._who(stream.target),
            )
            stream.sent[seq] = hashes
            del stream.hashes[seq]

    def _send_seal(self, stream: TargetStream) -> None:
        """Sign what this rank told the target: its manifest and every digest."""
        if self.signer is None or stream.manifest is None:
            return
        t0 = time.perf_counter()
        payload = seal_payload(stream.manifest, stream.sent.items())
        seal = Seal(
            refit=self.refit, signature=self.signer.sign(payload), key=self.signer.fingerprint
        )
        elapsed = time.perf_counter() - t0
        self.sign_s += elapsed
        self.control_s += elapsed
        self.agent.send_control(stream.target.agent, seal, who=self._who(stream.target))


def _entry(spec: TensorSpec) -> ManifestEntry:
    """A manifest entry; a sharded tensor's names its place and its source blocks."""
    if not isinstance(spec, ShardSpec):
        return ManifestEntry(name=spec.name, dtype=spec.dtype, shape=spec.shape)
    return ManifestEntry(
        name=spec.name,
        dtype=spec.dtype,
        shape=spec.shape,
        offset=spec.dest.offset,
        sources=tuple(
            SourceBox(rank=rank, offset=box.offset, size=box.size) for rank, box in spec.sources
        ),
    )


__all__ = ["Done", "RefitSender", "Routes", "Target", "for_target", "prepare_sources"]
