"""The rollout side of one refit: check the manifest, offer landing memory, verify, confirm.

Order of events for refit ``r``: the receiver admits the refit (:meth:`RefitReceiver.admit`,
:mod:`.admission`): it takes the first manifest of a policy peer, checks it (names, dtypes,
and the bucket plan, which it computes itself from the manifest and compares with the
sender's digest), computes its sources from ``(T, R)`` and the plan, and collects their
manifests; a refit whose sources disagree on the membership is declined.  It then tells
every source ``ready``, naming the memory tensors land in, and credits the receive buffers
of the first buckets that need one.
For each bucket ``k`` it waits for the WRITE's notification from ``bucket_sender(k)`` and
hands the bucket's bytes to the hash pool; at the end it compares every hash with the
sender's digest and only then confirms ``done``.

Two ways to receive:

* :meth:`RefitReceiver.into` (``targets``): every tensor lands in a caller's tensor of the
  same name, dtype and shape (its final memory: a model's parameters, or the spare copy of a
  double-buffered state).  A layout that does not match raises :class:`LayoutMismatchError`
  before ``ready`` is sent, i.e. before any byte lands.  No buffer, no credit: the senders
  stream all buckets back to back.
* :meth:`RefitReceiver.batches` (upstream's views API): whole tensors are views of a receive
  buffer, valid until the consumer asks for the next batch; tensors larger than a bucket land
  in reassembly memory kept across refits (:mod:`.staging`), valid until the next refit.  A
  buffer is credited again once the consumer resumed and the hash of its bytes is done.

A sharded refit (DTensor senders, :mod:`refit_worker.engine.planning.shard_plan`) names its senders
in the manifest's source boxes: the receiver connects to each on first use, every byte lands in the
target (or the reassembly memory of the views API, yielded whole at the end), and bucket ``k`` comes
from ``plan.senders[k]``.

A delta refit (the manifest's ``delta``, :mod:`refit_worker.engine.delta.codec`) is taken only by
:meth:`into` with a :class:`DeltaTarget` that serves the delta's base version; otherwise it is
declined with
``whole`` (the senders then send the refit whole) before anything lands.  Its one tensor
lands in memory of the receiver's own; once verified, the target applies it onto a spare
copy and checks the whole-state digest, and only then is ``done`` confirmed (a result that
is not the trainer's is declined with ``whole`` too: the served weights stay as they were).

Completeness and integrity are checked *before the last batch is yielded* (and before
:meth:`~RefitReceiver.into` returns): a refit that would end incomplete or corrupted raises
instead, so a caller that commits after the loop never commits a partial refit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from refit_worker.contract.entries import ServedVersion

from ..base import TensorMeta, dtype_from_name
from ..delta.codec import DELTA_TENSOR, DeltaArena, DeltaRejectedError
from ..messages.integrity import Hasher, algorithm_for, as_bytes
from ..messages.known_hashes import KnownHashes
from ..messages.signing import RefitVerifier, SealRecord, SignatureError, seal_payload
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
)
from ..planning.boxes import Box
from ..planning.buckets import (
    Plan,
    TensorSpec,
    buffer_handoffs,
    buffer_slots,
    cached_plan,
    check_unique_names,
    lands,
)
from ..planning.shard_plan import ShardSpec, cached_shard_plan
from ..transport.agent import REFIT_BACKOFF, NixlAgent
from ..transport.peers import disagreement, expected_sources
from ..transport.registry import MemoryRegistry
from .admission import Decliner, RefitDeclinedError, first_manifest, other_manifests
from .layout_checks import layout_problems
from .staging import Staging

#: Given the specs a manifest lists, the tensors to receive them into (by name).
TargetResolver = Callable[[Sequence[TensorSpec]], Mapping[str, torch.Tensor]]


class IncompleteRefitError(RuntimeError):
    """The received refit does not match its manifest (or failed its integrity check)."""


class LayoutMismatchError(IncompleteRefitError):
    """The tensors to receive into do not match the refit's; raised before any byte lands."""


@dataclass(frozen=True)
class DeltaTarget:
    """How one ``into`` takes a delta refit: the version the rank serves (None: none yet),
    and what applies a verified delta's bytes onto it, returning the filled spare tensors
    (raising :class:`~refit_worker.engine.delta.codec.DeltaRejectedError` when the result is
    not the trainer's)."""

    base: ServedVersion | None
    apply: Callable[[DeltaHeader, torch.Tensor], Mapping[str, torch.Tensor]]
    #: The digest of the served version cut into a sharded delta's blocks (raises
    #: ``ValueError`` when they do not fit it); None: sharded deltas are declined.
    base_blocks: Callable[[DeltaHeader], str] | None = None


@dataclass
class Source:
    """A policy rank that writes to this rollout rank."""

    rank: int
    agent: str


@dataclass
class Shared:
    """What a receiver shares with the next refits on the same connection."""

    registry: MemoryRegistry
    hasher: Callable[[], Hasher]
    #: Per source agent: landing set ids already sent in full on this connection.
    sent: dict[str, set[str]]
    staging: Staging | None = None
    #: Per source agent: the connection its last manifest named (``Manifest.connection``).
    connections: dict[str, str] = field(default_factory=dict)
    #: Where a delta's bytes land (kept across refits: registered once).
    delta_arena: DeltaArena = field(default_factory=DeltaArena)
    #: This rank checks integrity hashes (``transfer.checksum``): a manifest without them
    #: is refused, not taken unchecked.
    require_integrity: bool = False
    #: The job's public key: every source must seal what it sent
    #: (:mod:`refit_worker.engine.messages.signing`); None: refits are taken unsigned.
    verifier: RefitVerifier | None = None


class RefitReceiver:
    """Receives one refit from this rank's sources."""

    plan: Plan  # set once the manifest is checked

    def __init__(
        self,
        agent: NixlAgent,
        *,
        rank: int,
        refit: int,
        exact: bool,
        buffers: Sequence[torch.Tensor],
        peers: Callable[[], Mapping[int, str]],
        world: tuple[int, int, bool],
        timeout_s: float,
        device: torch.device,
        shared: Shared,
        decline: Decliner,
        delta: DeltaTarget | None = None,
    ) -> None:
        self.agent, self.rank, self.refit, self.exact = agent, rank, refit, exact
        self.buffers, self.peers, self.timeout_s = list(buffers), peers, timeout_s
        #: (train world size, rollout world size, stripe) of the membership this rank has.
        self.world = world
        self.device, self.shared, self.decline = device, shared, decline
        self.delta = delta
        #: A delta refit: the spare tensors it was applied onto (set before ``done``).
        self.applied: Mapping[str, torch.Tensor] | None = None
        self.sources: list[Source] = []  # this refit's, in turn order (set by admit)
        self.manifest: Manifest | None = None
        self._specs: list[TensorSpec] = []
        self.who = f"rollout rank {rank}: refit {refit}"
        self._memory: dict[str, torch.Tensor] = {}  # landing tensors as flat bytes, by name
        self._sizes: dict[str, int] = {}
        self._slots: list[int] = []
        self._frees: dict[int, int] = {}  # bucket -> later bucket that reuses its buffer
        self._hashes: dict[int, Future[tuple[int, ...]]] = {}
        self._verified: set[int] = set()
        #: Whole tensors' hashes over their landing memory, for the commit's seed offer.
        self.known = KnownHashes()
        self.integrity: str | None = None
        #: The key whose seals this refit passed (None: not checked).
        self.signed_by: str | None = None
        #: The seals that passed, kept with the commit for the peers it may seed.
        self.seals: tuple[SealRecord, ...] = ()
        self.seal_s = 0.0  # of ``control_s``: verifying them
        self._manifests: dict[int, Manifest] = {}  # as each source sent it, by policy rank
        self._theirs: dict[int, tuple[int, ...]] = {}  # each bucket's hashes as sent
        self._views = False
        self._by_rank: dict[int, Source] = {}  # a sharded refit's sources by policy rank
        self._offer: LandingSet | None = None
        #: Whether senders were told where to land (from then on, targets may change).
        self.exposed = False
        #: When senders were told ready / the refit was verified (monotonic); control seconds.
        self.started_at = self.ended_at = 0.0
        self.control_s = 0.0

    def _sender(self, seq: int) -> Source:
        if self.plan.senders is not None:
            return self._by_rank[self.plan.senders[seq]]
        return self.sources[self.plan.sender(seq, tuple(range(len(self.sources))))]

    @property
    def sharded(self) -> bool:
        return self.plan.senders is not None

    async def into(self, targets: TargetResolver) -> Mapping[str, torch.Tensor]:
        """Receive the refit straight into ``targets(specs)``; returns them, verified."""
        try:
            resolved = await self._begin(targets)
            for seq in range(len(self.plan.buckets)):
                await self._bucket(seq)
            await self._finish()
            return resolved if self.applied is None else self.applied
        except BaseException as exc:
            self.fail(exc)
            raise

    async def batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        """Yield lists of ``(name, tensor)`` views (see the module docstring)."""
        self._views = True
        try:
            await self._begin(None)
            total = len(self.plan.buckets)
            for seq in range(total):
                batch = await self._bucket(seq)
                if seq == total - 1:
                    await self._finish()
                    if self.sharded:  # blocks from several senders: whole at the end
                        batch = self._assembled()
                if batch:
                    yield batch
                await self._free(seq)
        except BaseException as exc:
            self.fail(exc)
            raise

    def fail(self, exc: BaseException) -> None:
        """The refit failed here: cancel the hashes, abort it to the sources."""
        for future in self._hashes.values():
            future.cancel()
        if isinstance(exc, RefitDeclinedError):
            return  # the sources were told: declined
        reason = f"rollout rank {self.rank}: {type(exc).__name__}: {exc}"
        for source in self.sources:
            self.agent.abort(source.agent, self.refit, reason)

    # -- set-up -----------------------------------------------------------------------
    async def _wait(self, source: Source, kind: str, seq: int, what: str) -> object:
        return await self.agent.wait_control(
            source.agent,
            kind,
            self.refit,
            seq,
            what=f"{self.who}: {what} (policy rank {source.rank}, within {self.timeout_s}s)",
            deadline=time.monotonic() + self.timeout_s,
            backoff=REFIT_BACKOFF,
        )

    async def admit(self) -> None:
        """Take this refit's manifests; ``RefitDeclinedError`` (sources told) when they are
        missing or disagree, before anything lands."""
        if self.exact:  # else older manifests are declined, not dropped unanswered
            self.agent.forget_before(self.refit)
        first, manifest = await first_manifest(
            self.agent,
            self.peers,
            refit=self.refit,
            exact=self.exact,
            timeout_s=self.timeout_s,
            who=self.who,
            decline=self.decline,
        )
        if not isinstance(manifest, Manifest):
            raise IncompleteRefitError(f"{self.who}: expected a manifest, got {manifest}")
        self.refit = manifest.refit
        self.who = f"rollout rank {self.rank}: refit {self.refit}"
        self.agent.forget_before(self.refit)
        peers = self.peers()
        self.sources = [Source(first, peers[first])]
        t0 = time.perf_counter()
        self._specs = self._check_manifest(manifest)
        train, rollout, stripe = self.world
        rollout = manifest.rollout_world_size or rollout
        if self.rank >= rollout:
            self._declined(list(peers), f"not among the {rollout} rollout ranks it was sent for")
        ranks = expected_sources(
            self.rank,
            train_world_size=train,
            rollout_world_size=rollout,
            stripe=stripe,
            sharded_senders=self.plan.senders,
        )
        if first not in ranks:
            self._declined([first], f"policy rank {first} is not one of its sources {ranks}")
        # Half the timeout: a decline must reach the present senders before they give up.
        others = await other_manifests(
            self.agent,
            {rank: peers.get(rank) for rank in ranks if rank != first},
            refit=self.refit,
            wait_s=self.timeout_s / 2,
        )
        reason = disagreement({first: manifest, **others})
        if reason is not None:
            self._declined(ranks, reason)
        self.sources = [Source(rank, peers[rank]) for rank in ranks]
        self._by_rank = {source.rank: source for source in self.sources}
        self._follow_connections({first: manifest, **others})
        self._manifests = {r: m for r, m in {first: manifest, **others}.items() if m is not None}
        if manifest.delta is not None:
            refused = self._refuses(manifest)
            if refused is not None:
                self._declined(ranks, refused, whole=True)
        self.manifest = manifest
        self.control_s += time.perf_counter() - t0

    def _follow_connections(self, manifests: Mapping[int, Manifest | None]) -> None:
        """A source on a new connection (it forgot this rank and found it again before this
        rank saw it go) knows none of the landing sets sent before: send them in full."""
        for rank, manifest in manifests.items():
            if manifest is None or manifest.connection is None:
                continue
            agent = self._by_rank[rank].agent
            if self.shared.connections.get(agent) != manifest.connection:
                self.shared.sent.pop(agent, None)
                self.shared.connections[agent] = manifest.connection

    def _refuses(self, manifest: Manifest) -> str | None:
        """Why this receive cannot take the manifest's delta (None: it can)."""
        delta = manifest.delta
        if delta is None:
            return None
        entries = [(e.name, e.dtype, e.shape) for e in manifest.tensors]
        if entries != [(DELTA_TENSOR, "uint8", (delta.nbytes,))]:
            raise IncompleteRefitError(
                f"{self.who}: a delta manifest must list the one tensor {DELTA_TENSOR!r} of "
                f"{delta.nbytes} bytes, it lists {entries[:3]}"
            )
        if self.delta is None:
            return "this receive takes whole refits only (in place, or as views)"
        base = self.delta.base
        if base is None:
            return "it serves no version yet"
        if delta.blocks is not None:
            return self._refuses_blocks(base, delta)
        if (base.refit, base.digest) != (delta.base_refit, delta.base_digest):
            return (
                f"it serves refit {base.refit} ({base.digest}), the delta is onto refit "
                f"{delta.base_refit} ({delta.base_digest})"
            )
        return None

    def _refuses_blocks(self, base: ServedVersion, delta: DeltaHeader) -> str | None:
        """A sharded delta's base is checked block by block: no sender hashed a whole tensor."""
        if base.refit != delta.base_refit:
            return f"it serves refit {base.refit}, the delta is onto refit {delta.base_refit}"
        if self.delta is None or self.delta.base_blocks is None:
            return "this receive does not take sharded deltas"
        try:
            ours = self.delta.base_blocks(delta)
        except ValueError as exc:
            return f"the delta's blocks do not fit the version it serves: {exc}"
        if ours != delta.base_digest:
            return (
                f"its refit {base.refit} in the delta's blocks is {ours}, the delta is onto "
                f"{delta.base_digest}"
            )
        return None

    def _declined(self, ranks: Sequence[int], reason: str, *, whole: bool = False) -> None:
        peers = self.peers()
        for rank in ranks:
            if rank in peers:
                self.decline(peers[rank], self.refit, reason, whole=whole)
        raise RefitDeclinedError(self.refit, reason, whole=whole)

    async def _begin(self, targets: TargetResolver | None) -> Mapping[str, torch.Tensor]:
        if self.manifest is None:
            await self.admit()
        manifest, specs = self.manifest, self._specs
        if manifest is None:
            raise RuntimeError("the refit was not admitted (engine bug)")
        t0 = time.perf_counter()
        resolved: Mapping[str, torch.Tensor] = {}
        if manifest.delta is not None:
            memory = self.shared.delta_arena.take(manifest.delta.nbytes, self.device)
            resolved = landing = {DELTA_TENSOR: memory}
        elif targets is not None:
            resolved = targets(specs)
            problems = layout_problems(specs, resolved, self.device)
            if problems:
                raise LayoutMismatchError(
                    f"{self.who}: the tensors to receive into do not match the "
                    f"{len(specs)} tensors sent; nothing was written. " + "; ".join(problems)
                )
            landing = {spec.name: resolved[spec.name] for spec in specs}
        else:
            landing = self._stage(specs, manifest.bucket_size)
        self.shared.registry.next_refit()
        offer = self.shared.registry.landing_set(landing) if landing else None
        self._memory = {name: as_bytes(t) for name, t in landing.items() if t.numel()}
        self._sizes = {t.name: t.nbytes for t in offer.tensors} if offer else {}
        self._slots = buffer_slots(self.plan.buckets, self._sizes, len(self.buffers))
        upfront, self._frees = buffer_handoffs(self._slots, len(self.buffers))
        self.exposed = True
        # The transfer can start now: what came before (checks, allocating and registering
        # landing memory) is control work, counted in control_s.
        self.started_at = time.monotonic()
        for source in self.sources:
            known = offer is not None and offer.id in self.shared.sent.get(source.agent, set())
            self.agent.send_control(
                source.agent,
                Ready(
                    refit=self.refit,
                    landing=offer if offer is not None and not known else None,
                    landing_id=offer.id if offer is not None and known else None,
                ),
                who=f"rollout rank {self.rank}: policy rank {source.rank}",
            )
        self._offer = offer
        for seq in upfront:
            self._credit(seq)
        self.control_s += time.perf_counter() - t0
        return resolved

    def _check_manifest(self, manifest: Manifest) -> list[TensorSpec]:
        try:
            check_unique_names([entry.name for entry in manifest.tensors])
            for entry in manifest.tensors:
                dtype_from_name(entry.dtype)
            sharded = [e.sources is not None for e in manifest.tensors]
            specs: list[TensorSpec]
            if any(sharded):
                if not all(sharded):
                    raise ValueError("some entries list source blocks and some do not")
                shard_specs = [_shard_spec(e) for e in manifest.tensors]
                self.plan = cached_shard_plan(shard_specs, manifest.bucket_size)
                specs = list(shard_specs)
            else:
                specs = [TensorSpec(e.name, e.dtype, e.shape) for e in manifest.tensors]
                self.plan = cached_plan(specs, manifest.bucket_size)
        except ValueError as exc:
            raise IncompleteRefitError(f"{self.who}: bad manifest: {exc}") from exc
        if (self.plan.digest, len(self.plan.buckets)) != (manifest.digest, manifest.total_buckets):
            raise IncompleteRefitError(
                f"{self.who}: the manifest lists tensors that plan into {len(self.plan.buckets)} "
                f"buckets (digest {self.plan.digest}), but says {manifest.total_buckets} "
                f"(digest {manifest.digest})"
            )
        if manifest.integrity is None and self.shared.require_integrity:
            raise IncompleteRefitError(
                f"{self.who}: the manifest carries no integrity hashes, and this rank checks "
                "every byte (transfer.checksum): refused unchecked"
            )
        verifier = self.shared.verifier
        if verifier is not None and manifest.sealed_by != verifier.fingerprint:
            raise IncompleteRefitError(
                f"{self.who}: "
                + (
                    f"the refit is sealed with key {manifest.sealed_by}, not the job's "
                    f"{verifier.fingerprint}"
                    if manifest.sealed_by
                    else f"unsigned, and this rank takes only refits signed with the job's key "
                    f"{verifier.fingerprint}"
                )
                + ": refused"
            )
        if manifest.integrity is None and verifier is not None:
            raise IncompleteRefitError(
                f"{self.who}: the manifest carries no integrity hashes, so no signature could "
                "pin its bytes, and this rank takes only signed refits: refused"
            )
        if manifest.integrity is not None and manifest.integrity != algorithm_for(self.device):
            raise IncompleteRefitError(
                f"{self.who}: integrity hash {manifest.integrity!r} does not fit memory on "
                f"{self.device} (expected {algorithm_for(self.device)!r})"
            )
        self.integrity = manifest.integrity
        return specs

    async def _check_seals(self) -> None:
        """Every source's seal over the manifest it sent and the hashes this rank checked
        the landed bytes against: the bytes are then the key holder's (a policy rank's)."""
        verifier = self.shared.verifier
        if verifier is None:
            return
        sent: dict[int, list[tuple[int, tuple[int, ...]]]] = {s.rank: [] for s in self.sources}
        for seq, hashes in self._theirs.items():
            sent[self._sender(seq).rank].append((seq, hashes))
        records: list[SealRecord] = []
        for source in self.sources:
            found = await self._wait(source, "seal", 0, "the refit's seal")
            who = f"{self.who} from policy rank {source.rank} ({source.agent})"
            manifest = self._manifests.get(source.rank)
            if not isinstance(found, Seal) or manifest is None:
                raise IncompleteRefitError(f"{who}: expected its manifest and seal, got {found}")
            t0 = time.perf_counter()
            try:
                if found.key != verifier.fingerprint:
                    raise SignatureError(
                        f"{who}: sealed with key {found.key}, not the job's {verifier.fingerprint}"
                    )
                verifier.verify(seal_payload(manifest, sent[source.rank]), found.signature, who)
            except SignatureError as exc:
                raise IncompleteRefitError(str(exc)) from None
            finally:
                self.seal_s += time.perf_counter() - t0
            digests = tuple(sorted(sent[source.rank]))
            records.append(
                SealRecord(
                    manifest=manifest, digests=digests, signature=found.signature, key=found.key
                )
            )
        self.signed_by, self.seals = verifier.fingerprint, tuple(records)
        self.control_s += self.seal_s

    def _apply_delta(self) -> None:
        """A delta refit: apply its verified bytes onto the spare copy; a result that is
        not the trainer's is declined (``whole``), so the senders send it whole."""
        manifest = self.manifest
        if manifest is None or manifest.delta is None or self.delta is None:
            return
        data = self._memory.get(DELTA_TENSOR, torch.empty(0, dtype=torch.uint8))
        try:
            self.applied = self.delta.apply(manifest.delta, data)
        except DeltaRejectedError as exc:
            self._declined([source.rank for source in self.sources], str(exc), whole=True)

    def _assembled(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of a sharded refit, whole, as views of its reassembly memory."""
        found = []
        for spec in self.plan.specs:
            dtype = dtype_from_name(spec.dtype)
            memory = self._memory.get(spec.name)
            if memory is None:
                found.append((spec.name, torch.empty(spec.shape, dtype=dtype, device=self.device)))
            else:
                found.append((spec.name, memory.view(dtype).view(spec.shape)))
        return found

    def _stage(self, specs: Sequence[TensorSpec], bucket_size: int) -> dict[str, torch.Tensor]:
        """Reassembly memory for the tensors larger than a bucket, or for every tensor of a
        sharded refit (views API)."""
        staging = self.shared.staging
        if staging is None:
            raise RuntimeError("the views API needs reassembly memory (engine bug)")
        big = [spec for spec in specs if spec.nbytes > bucket_size or self.sharded]
        staging.keep_only(spec.name for spec in big)
        return {spec.name: staging.get(spec.name, spec.nbytes, self.device) for spec in big}

    def _credit(self, seq: int) -> None:
        source = self._sender(seq)
        self.agent.send_control(
            source.agent,
            Credit(refit=self.refit, seq=seq, buffer=self._slots[seq]),
            who=f"rollout rank {self.rank}: policy rank {source.rank}",
        )

    # -- buckets ----------------------------------------------------------------------
    async def _bucket(self, seq: int) -> list[tuple[str, torch.Tensor]]:
        source, slot = self._sender(seq), self._slots[seq]
        message = await self._wait(source, "bucket", seq, f"bucket {seq}")
        if not isinstance(message, BucketReady):
            raise IncompleteRefitError(f"{self.who}: expected bucket {seq}, got {message}")
        if message.digest != self.plan.digest:
            raise IncompleteRefitError(
                f"{self.who}: policy rank {source.rank} sent bucket {seq} of plan "
                f"{message.digest}, the manifest's is {self.plan.digest}: striping senders "
                "disagree on the weights"
            )
        if message.buffer != slot:
            raise IncompleteRefitError(
                f"{self.who}: bucket {seq} went to buffer {message.buffer}, expected {slot}"
            )
        views: list[torch.Tensor] = []
        batch: list[tuple[str, torch.Tensor]] = []
        for piece in self.plan.buckets[seq]:
            data = self._bytes(piece, slot)
            views.append(data)
            item = self._complete(piece, data) if self._views and not self.sharded else None
            if item is not None:
                batch.append(item)
        if self.integrity is not None:
            self._hashes[seq] = self.shared.hasher().submit(views, algorithm_for(self.device))
            self._check_digests(block=False)
        return batch

    def _bytes(self, piece: TensorMeta, slot: int) -> torch.Tensor:
        end = piece.chunk_offset + piece.chunk_size
        if lands(piece, self._sizes):
            return self._memory[piece.name][piece.chunk_offset : end]
        if piece.chunk_size == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        buffer = self.buffers[slot]
        if piece.offset + piece.chunk_size > buffer.numel():
            raise IncompleteRefitError(f"{self.who}: piece {piece} lies outside its buffer")
        return buffer[piece.offset : piece.offset + piece.chunk_size]

    def _complete(self, piece: TensorMeta, data: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """The whole tensor once its last piece is in (views API), else None."""
        if piece.chunk_offset + piece.chunk_size < piece.nbytes:
            return None
        dtype = dtype_from_name(piece.dtype)
        if piece.nbytes == 0:
            return piece.name, torch.empty(piece.shape, dtype=dtype, device=self.device)
        whole = self._memory.get(piece.name, data) if not piece.is_whole else data
        return piece.name, whole.view(dtype).view(piece.shape)

    async def _free(self, seq: int) -> None:
        """The consumer is done with bucket ``seq``: credit the bucket that reuses its buffer."""
        later = self._frees.get(seq)
        if later is None:
            return
        if seq in self._hashes:
            await asyncio.wrap_future(self._hashes[seq])  # the hash still reads the buffer
        if self.device.type == "cuda":
            # The consumer's copies out of the views may still be queued on its stream.
            torch.cuda.current_stream(self.device).synchronize()
        self._credit(later)

    # -- completion -------------------------------------------------------------------
    def _check_digests(self, *, block: bool) -> None:
        for seq, future in self._hashes.items():
            if seq in self._verified or not future.done():
                continue
            found = self.agent.take_control(self._sender(seq).agent, "digest", self.refit, seq)
            if found is None:
                continue
            self._compare(seq, future.result(), found)

    def _compare(self, seq: int, mine: tuple[int, ...], theirs: object) -> None:
        pieces = self.plan.buckets[seq]
        if not isinstance(theirs, Digest) or len(theirs.hashes) != len(pieces):
            raise IncompleteRefitError(f"{self.who}: bad digest for bucket {seq}: {theirs}")
        for piece, got, want in zip(pieces, mine, theirs.hashes, strict=True):
            if got != want:
                raise IncompleteRefitError(
                    f"{self.who}: tensor {piece.name!r} bytes {piece.chunk_offset}.."
                    f"{piece.chunk_offset + piece.chunk_size} failed the {self.integrity} "
                    "integrity check: the bytes that landed differ from those sent"
                )
        self._theirs[seq] = theirs.hashes
        self._verified.add(seq)
        if not self._views and self.manifest is not None and self.manifest.delta is None:
            landed = [lands(piece, self._sizes) for piece in pieces]
            self.known.verified(pieces, self._hashes[seq], self._memory, landed)

    async def _finish(self) -> None:
        """Verify every bucket's hash, then confirm ``done`` to every source."""
        if self.integrity is not None:
            for seq, future in sorted(self._hashes.items()):
                if seq in self._verified:
                    continue
                mine = await asyncio.wrap_future(future)
                theirs = await self._wait(self._sender(seq), "digest", seq, f"digest {seq}")
                self._compare(seq, mine, theirs)
        await self._check_seals()
        self._apply_delta()
        self.shared.registry.sweep(keep=2)
        for source in self.sources:
            # Every source used this refit's landing set: from now on it is named by id.
            # (Only now: a source that failed before reading it must get it in full again.)
            if self._offer is not None:
                self.shared.sent.setdefault(source.agent, set()).add(self._offer.id)
            self.agent.send_control(
                source.agent,
                Done(refit=self.refit),
                who=f"rollout rank {self.rank}: policy rank {source.rank}",
            )
        self.agent.poll()  # one progress call: usually enough to send it
        self.ended_at = time.monotonic()
        whole = self.manifest is not None and self.manifest.delta is None
        if self.integrity is not None and whole and not self._views:
            # Beside the commit, off the path to ``done``: the tensors sent in pieces.
            self.known.hash_the_rest(self._memory, self.shared.hasher(), algorithm_for(self.device))


def _shard_spec(entry: ManifestEntry) -> ShardSpec:
    if entry.sources is None:
        raise ValueError(f"not a sharded manifest entry: {entry}")
    return ShardSpec(
        entry.name,
        entry.dtype,
        entry.shape,
        offset=entry.offset or tuple(0 for _ in entry.shape),
        sources=tuple((s.rank, Box(s.offset, s.size)) for s in entry.sources),
    )


__all__ = [
    "DeltaTarget",
    "IncompleteRefitError",
    "LayoutMismatchError",
    "RefitReceiver",
    "Shared",
    "Source",
    "TargetResolver",
    "layout_problems",
]
