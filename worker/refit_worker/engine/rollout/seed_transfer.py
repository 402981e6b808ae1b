"""Peer seeding over NIXL: a rollout rank offers its last committed refit, a new rollout
rank READs it from one or several such peers, and nothing is committed unverified.

The seeder (:class:`SeedOffer`) does nothing per seed: the reads are one-sided.  After
each commit it rewrites a *seed manifest* in one small registered region: the refit id,
each committed tensor's name, wire dtype, shape and integrity hash (of the bytes it
committed, which the refit's own checks had verified), and a
:class:`~refit_worker.engine.messages.wire.LandingSet` saying where those bytes are (addresses plus
NIXL's partial metadata of their registrations).  Where the region is goes into the rank's
published metadata once (:class:`~refit_worker.contract.entries.SeedPointer`); the
manifest itself never crosses the rendezvous store, so its size does not grow the
ConfigMaps.  The region holds ``[8-byte body length][8-byte xxh3 of the body][body]``:
a reader whose READ raced a rewrite sees a body that does not match its hash.

The reader (:func:`pull`) READs the manifest of every candidate, takes the highest refit
(at least ``min_refit``) and the peers whose manifests of it agree tensor for tensor,
stripes the tensors over those peers by bytes, READs each share straight into the
targets, then hashes what landed and compares every tensor with the manifest.  A peer
that began overwriting that copy with a newer refit while it was read (double buffering
keeps a committed copy intact only until the refit after next starts), a peer that went
away, or a manifest that does not match raises :class:`SeedError`; the caller then takes
the policy's send as before.  A JSON body validated by pydantic, no code-executing format.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import xxhash
from pydantic import Field, ValidationError

from ..base import dtype_name
from ..messages.integrity import Algorithm, algorithm_for, as_bytes, hash_bytes, state_digest
from ..messages.known_hashes import KnownHash, tensor_hashes
from ..messages.signing import RefitVerifier, SealRecord, SignatureError
from ..messages.wire import LandingSet, NixlAgentMetadata, _Model
from ..planning.buckets import TensorSpec, cached_plan
from ..transport.agent import NixlAgent, PeerError, Region
from ..transport.registry import MemoryRegistry, device_id
from .refit_receive import TargetResolver

_HEADER = struct.Struct("<QQ")  # body length, xxh3_64 of the body
#: How long a peer's manifest READ may take before the peer is passed over.
MANIFEST_TIMEOUT_S = 5.0
#: Room the manifest region leaves beyond the first body, so later ones rarely outgrow it.
_SLACK = 2.0


class SeedError(RuntimeError):
    """Seeding from peers did not give a verified refit; nothing was committed."""


class SeedTensor(_Model):
    """One offered tensor: its layout and the integrity hash of its committed bytes."""

    name: str = Field(min_length=1)
    dtype: str = Field(min_length=1)
    shape: tuple[int, ...]
    hash: int = Field(ge=0)


class SeedManifest(_Model):
    """What a seeder offers now (see the module docstring)."""

    refit: int = Field(ge=0)
    algorithm: Algorithm
    tensors: tuple[SeedTensor, ...] = Field(min_length=1)
    landing: LandingSet
    #: The trainer's seals of this refit, as the seeder checked them (empty: it checked
    #: none); a reader with the job's key checks the bytes against these, not the hashes
    #: above alone, which are the seeder's own word.
    seals: tuple[SealRecord, ...] = ()

    @property
    def digest(self) -> str:
        """The offered state's digest (:func:`state_digest`)."""
        return state_digest(
            self.algorithm, ((t.name, t.dtype, t.shape, t.hash) for t in self.tensors)
        )


@dataclass(frozen=True, slots=True)
class SeedSource:
    """A peer to seed from: its label (``rollout-<rank>``), agent metadata and where its
    manifest is (the region and NIXL's partial metadata of it)."""

    label: str
    agent: NixlAgentMetadata
    region: Region
    region_metadata: bytes


@dataclass(frozen=True, slots=True)
class Seeded:
    """A verified seed: the targets filled, the refit, who gave which bytes, the cost."""

    tensors: Mapping[str, torch.Tensor]
    refit: int
    sources: tuple[str, ...]
    bytes: int
    seconds: float
    #: The job key whose seals the bytes were checked against (None: not checked), and
    #: those seals (this rank forwards them when it seeds others in turn).
    signed_by: str | None = None
    seals: tuple[SealRecord, ...] = ()


def encode_manifest(manifest: SeedManifest) -> bytes:
    body = manifest.model_dump_json().encode()
    return _HEADER.pack(len(body), xxhash.xxh3_64_intdigest(body)) + body


def decode_manifest(raw: bytes, who: str) -> SeedManifest:
    """The manifest in a READ region; :class:`SeedError` if it is torn or malformed."""
    if len(raw) < _HEADER.size:
        raise SeedError(f"{who}: seed region of {len(raw)} bytes holds no manifest")
    length, digest = _HEADER.unpack_from(raw)
    body = raw[_HEADER.size : _HEADER.size + length]
    if length == 0 or len(body) != length or xxhash.xxh3_64_intdigest(body) != digest:
        raise SeedError(f"{who}: seed manifest torn or not written yet (read again)")
    try:
        return SeedManifest.model_validate_json(body)
    except ValidationError as exc:
        raise SeedError(f"{who}: seed manifest does not validate: {exc}") from exc


class SeedOffer:
    """A rollout rank's offer of its committed refit (see the module docstring)."""

    def __init__(self, agent: NixlAgent, registry: MemoryRegistry, device: torch.device) -> None:
        self._agent, self._registry, self.device = agent, registry, device
        self._region: torch.Tensor | None = None
        self._handle: object = None
        #: Where the manifest is, for the rank's metadata (None until the first commit).
        self.pointer: tuple[Region, bytes] | None = None
        #: The digest of the last state offered (None until the first commit).
        self.digest: str | None = None

    def publish(
        self,
        refit: int,
        committed: Mapping[str, torch.Tensor],
        seals: Sequence[SealRecord] = (),
        known: Mapping[str, KnownHash] | None = None,
    ) -> bool:
        """Offer ``committed`` as refit ``refit`` (with the trainer's ``seals`` of it); True
        when the region moved (the rank must publish its metadata again with the new
        :attr:`pointer`).  ``known``: hashes the receive already took of this memory."""
        self.digest = None  # until this refit's is known: never the one before's
        named = {n: t for n, t in committed.items() if t.numel()}
        if not named:
            return False
        algorithm = algorithm_for(self.device)
        hashes = tensor_hashes(named, algorithm, known or {})
        manifest = SeedManifest(
            refit=refit,
            algorithm=algorithm,
            tensors=tuple(
                SeedTensor(name=n, dtype=dtype_name(t.dtype), shape=tuple(t.shape), hash=hashes[n])
                for n, t in named.items()
            ),
            landing=self._registry.landing_set(named),
            seals=tuple(seals),
        )
        self.digest = manifest.digest
        raw = encode_manifest(manifest)
        moved = self._ensure(len(raw))
        region = self._region
        assert region is not None  # _ensure made it
        # Length first as 0: a reader mid-rewrite sees "not written", never a mixed body.
        region[: _HEADER.size].zero_()
        region[_HEADER.size : len(raw)].copy_(
            torch.frombuffer(bytearray(raw[_HEADER.size :]), dtype=torch.uint8)
        )
        region[: _HEADER.size].copy_(
            torch.frombuffer(bytearray(raw[: _HEADER.size]), dtype=torch.uint8)
        )
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return moved

    def _ensure(self, nbytes: int) -> bool:
        if self._region is not None and self._region.numel() >= nbytes:
            return False
        self.close()
        size = int(nbytes * _SLACK) + 4096
        self._region = torch.zeros(size, dtype=torch.uint8, device=self.device)
        region: Region = (self._region.data_ptr(), size, device_id(self._region))
        mem_type = self._registry.mem_type
        self._handle = self._agent.register([region], mem_type)
        self.pointer = (region, self._agent.memory_metadata(self._handle))
        return True

    def close(self) -> None:
        """Deregister and free the manifest region (the offer is withdrawn)."""
        if self._handle is not None:
            self._agent.deregister(self._handle)
        self._handle, self._region, self.pointer = None, None, None


class _Reader:
    """One seed: the peers loaded, their manifests read (see :func:`pull`)."""

    def __init__(self, agent: NixlAgent, registry: MemoryRegistry, device: torch.device) -> None:
        self.agent, self.registry, self.device = agent, registry, device
        self.loaded: set[str] = set()

    def load(self, source: SeedSource) -> None:
        name = source.agent.agent_name
        if name not in self.loaded:
            try:
                self.agent.add_remote_agent(source.agent)
            except Exception:
                # Loaded before (an earlier seed): load it afresh.
                self.agent.reload_remote_agent(source.agent)
            self.loaded.add(name)
        self.agent.add_remote_memory(name, source.region_metadata)

    async def manifest(self, source: SeedSource, deadline: float) -> SeedManifest:
        addr, nbytes, dev = source.region
        local = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        handle = self.agent.register(
            [(local.data_ptr(), nbytes, device_id(local))], self.registry.mem_type
        )
        try:
            self.load(source)
            await self.agent.read(
                source.agent.agent_name,
                [(local.data_ptr(), nbytes, device_id(local))],
                [(addr, nbytes, dev)],
                self.registry.mem_type,
                what="the seed manifest",
                deadline=deadline,
            )
        finally:
            self.agent.deregister(handle)
        return decode_manifest(bytes(local.cpu().numpy().tobytes()), source.label)


def _agreeing(
    manifests: Sequence[tuple[SeedSource, SeedManifest]], min_refit: int
) -> list[tuple[SeedSource, SeedManifest]]:
    """The peers offering the highest refit >= ``min_refit`` whose tensors (names, layout,
    hashes) agree with the first such peer's; empty when none offers one."""
    usable = [(s, m) for s, m in manifests if m.refit >= min_refit]
    if not usable:
        return []
    best = max(m.refit for _, m in usable)
    first = next(m for _, m in usable if m.refit == best)
    return [(s, m) for s, m in usable if m.refit == best and m.tensors == first.tensors]


def stripes(sizes: Mapping[str, int], peers: int) -> list[list[str]]:
    """Tensor names split over ``peers`` so each READs about the same bytes (largest
    first, each to the least loaded peer)."""
    shares: list[list[str]] = [[] for _ in range(peers)]
    loads = [0] * peers
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        least = loads.index(min(loads))
        shares[least].append(name)
        loads[least] += sizes[name]
    return shares


async def pull(
    agent: NixlAgent,
    registry: MemoryRegistry,
    device: torch.device,
    sources: Sequence[SeedSource],
    *,
    min_refit: int,
    resolve: TargetResolver,
    timeout_s: float,
    verifier: RefitVerifier | None = None,
) -> Seeded:
    """Seed refit >= ``min_refit`` from ``sources`` into ``resolve(specs)`` (see the module
    docstring); :class:`SeedError` when no peer gave a verified one."""
    deadline = time.monotonic() + timeout_s
    reader = _Reader(agent, registry, device)
    manifests: list[tuple[SeedSource, SeedManifest]] = []
    problems: list[str] = []
    for source in sources:
        # A few seconds for a manifest of a few KiB: a peer that cannot answer that soon
        # (gone, or not progressing its NIXL worker) is passed over, not waited for.
        quick = min(deadline, time.monotonic() + MANIFEST_TIMEOUT_S)
        try:
            manifests.append((source, await reader.manifest(source, quick)))
        except (PeerError, SeedError, TimeoutError) as exc:
            problems.append(f"{source.label}: {exc}")
    chosen = _agreeing(manifests, min_refit)
    if not chosen:
        refits = sorted(m.refit for _, m in manifests)
        raise SeedError(
            f"no peer offers a refit >= {min_refit} (offered: {refits}; "
            f"problems: {problems or 'none'})"
        )
    manifest = chosen[0][1]
    if manifest.algorithm != algorithm_for(device):
        raise SeedError(
            f"peers hashed their copy with {manifest.algorithm}, memory here takes "
            f"{algorithm_for(device)}: seed between ranks of one memory kind"
        )
    specs = [TensorSpec(t.name, t.dtype, t.shape) for t in manifest.tensors]
    targets = resolve(specs)
    _check_targets(specs, targets)
    started = time.monotonic()
    shares = stripes({s.name: s.nbytes for s in specs}, len(chosen))
    # Each peer's share at once: the point of striping is that the peers' links add up.
    used = [(s, m, names) for (s, m), names in zip(chosen, shares, strict=True) if names]
    await asyncio.gather(
        *(
            _read_share(reader, s, m.landing, names, targets=targets, deadline=deadline)
            for s, m, names in used
        )
    )
    _verify(manifest, targets, device)
    labels = tuple(s.label for s, _, _ in used)
    seeded = Seeded(dict(targets), manifest.refit, labels, sum(s.nbytes for s in specs), 0.0)
    return _signed(seeded, manifest, verifier, time.monotonic() - started)


def _signed(
    seeded: Seeded, manifest: SeedManifest, verifier: RefitVerifier | None, seconds: float
) -> Seeded:
    """The seed, anchored to the trainer's seals when this rank holds the job's key."""
    if verifier is None:
        return replace(seeded, seconds=seconds)
    who = f"seed of refit {manifest.refit} from {seeded.sources[0]}"
    anchor(manifest, seeded.tensors, verifier, who)
    return replace(seeded, seconds=seconds, signed_by=verifier.fingerprint, seals=manifest.seals)


def anchor(
    manifest: SeedManifest,
    targets: Mapping[str, torch.Tensor],
    verifier: RefitVerifier,
    who: str,
) -> None:
    """Check a landed seed against the trainer's seals it carries (:class:`SeedError`
    unless they verify with the job's key and pin every offered byte): a version that
    arrived whole by the sealed piece hashes, one that arrived as a delta by the sealed
    whole-state digest of its result.  The peer's own hashes count for nothing here."""
    if not manifest.seals:
        raise SeedError(
            f"{who}: the peer holds no trainer seal of it, and a peer cannot vouch for its "
            f"own copy (this rank takes only what the job's key {verifier.fingerprint} "
            "signed)"
        )
    for record in manifest.seals:
        if record.manifest.refit != manifest.refit:
            raise SeedError(f"{who}: it carries a seal of refit {record.manifest.refit}")
        try:
            verifier.verify(record.payload(), record.signature, who)
        except SignatureError as exc:
            raise SeedError(str(exc)) from None
    delta = manifest.seals[0].manifest.delta
    if delta is not None:
        # The sealed result digest of a (non-sharded) delta: the offered hashes were just
        # checked against the landed bytes, so their digest is the landed state's.
        if delta.blocks is not None or manifest.digest != delta.digest:
            raise SeedError(
                f"{who}: the landed state's digest {manifest.digest} is not the one the "
                f"trainer sealed for it ({delta.digest})"
            )
        return
    _sealed_pieces(manifest, targets, who)


def _sealed_pieces(manifest: SeedManifest, targets: Mapping[str, torch.Tensor], who: str) -> None:
    """Every offered byte under a sealed piece hash: the buckets are planned again from
    each sealed manifest (a pure function of it) and each piece hashed where it landed."""
    algorithm = manifest.algorithm
    covered = dict.fromkeys((t.name for t in manifest.tensors), 0)
    for record in manifest.seals:
        entries = record.manifest.tensors
        if any(e.sources is not None for e in entries):
            raise SeedError(f"{who}: its seals are of a sharded send, which no seed re-checks")
        specs = [TensorSpec(e.name, e.dtype, e.shape) for e in entries]
        plan = cached_plan(specs, record.manifest.bucket_size)
        for seq, hashes in record.digests:
            pieces = plan.buckets[seq] if seq < len(plan.buckets) else ()
            if len(pieces) != len(hashes):
                raise SeedError(f"{who}: a seal's bucket {seq} does not fit its manifest")
            for piece, sealed in zip(pieces, hashes, strict=True):
                if piece.chunk_size == 0:
                    continue  # an empty tensor: nothing offered, nothing to pin
                target = targets.get(piece.name)
                if target is None or piece.name not in covered:
                    raise SeedError(f"{who}: sealed tensor {piece.name!r} is not in the seed")
                end = piece.chunk_offset + piece.chunk_size
                if hash_bytes(as_bytes(target)[piece.chunk_offset : end], algorithm) != sealed:
                    raise SeedError(
                        f"{who}: tensor {piece.name!r} bytes {piece.chunk_offset}..{end} are "
                        "not the ones the trainer sealed"
                    )
                covered[piece.name] += piece.chunk_size
    for offered in manifest.tensors:
        target = targets[offered.name]
        if covered[offered.name] != target.numel() * target.element_size():
            raise SeedError(f"{who}: no seal covers all of tensor {offered.name!r}")


def _check_targets(specs: Sequence[TensorSpec], targets: Mapping[str, torch.Tensor]) -> None:
    for spec in specs:
        target = targets.get(spec.name)
        if target is None:
            raise SeedError(f"no target for the seeded tensor {spec.name!r}")
        if dtype_name(target.dtype) != spec.dtype or tuple(target.shape) != spec.shape:
            raise SeedError(
                f"target {spec.name!r} is {target.dtype}{tuple(target.shape)}, the seed "
                f"{spec.dtype}{spec.shape}"
            )
        if not target.is_contiguous():
            raise SeedError(f"target {spec.name!r} is not contiguous")


async def _read_share(
    reader: _Reader,
    source: SeedSource,
    landing: LandingSet,
    names: Sequence[str],
    *,
    targets: Mapping[str, torch.Tensor],
    deadline: float,
) -> None:
    where = {t.name: t for t in landing.tensors}
    local: list[Region] = []
    remote: list[Region] = []
    reader.registry.ensure(targets[n] for n in names)
    for name in names:
        target, offered = targets[name], where.get(name)
        nbytes = target.numel() * target.element_size()
        if offered is None or offered.nbytes != nbytes:
            raise SeedError(f"{source.label}: its landing set does not hold {name!r} whole")
        local.append((target.data_ptr(), nbytes, device_id(target)))
        remote.append((offered.addr, nbytes, offered.dev_id))
    try:
        # Inside: a peer that left since its manifest was read (a drained pod that
        # stopped staying) fails here already; that is a failed seed, not this rank's.
        if landing.metadata:
            reader.agent.add_remote_memory(source.agent.agent_name, landing.metadata)
        await reader.agent.read(
            source.agent.agent_name,
            local,
            remote,
            reader.registry.mem_type,
            what=f"{len(names)} seeded tensors",
            deadline=deadline,
        )
    except (PeerError, TimeoutError) as exc:
        raise SeedError(f"{source.label}: {exc}") from exc


def _verify(
    manifest: SeedManifest, targets: Mapping[str, torch.Tensor], device: torch.device
) -> None:
    """Every landed tensor against the seeder's hash of its committed bytes."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    algorithm = algorithm_for(device)
    for offered in manifest.tensors:
        got = hash_bytes(as_bytes(targets[offered.name]), algorithm)
        if got != offered.hash:
            raise SeedError(
                f"seeded tensor {offered.name!r} of refit {manifest.refit} does not match "
                "its hash (the peer moved on to a newer refit while it was read, or its "
                "copy is corrupt); nothing committed"
            )


def pointer_metadata(metadata: bytes) -> str:
    return base64.b64encode(metadata).decode("ascii")


def metadata_from_pointer(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


__all__ = [
    "SeedError",
    "SeedManifest",
    "SeedOffer",
    "SeedSource",
    "SeedTensor",
    "Seeded",
    "anchor",
    "decode_manifest",
    "encode_manifest",
    "metadata_from_pointer",
    "pointer_metadata",
    "pull",
    "stripes",
]
