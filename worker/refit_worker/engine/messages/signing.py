"""Signed refits: the trainer is the root of trust.

A job has one Ed25519 key pair.  Policy ranks hold the private half (the operator's Secret,
or the key ``refit run`` makes) and *seal* what they send each rollout rank: the manifest
exactly as sent (names, shapes, dtypes, bucket plan, refit id, membership, a delta's base
and result digests) and the integrity hash of every piece they sent, in bucket order.  A
rollout rank holding the public half accepts a refit only when every source's seal
verifies over the manifest it received and the hashes it compared its landed bytes with;
the bytes are pinned by those hashes, the hashes by the signature.  A rank of another role
(or another job) has no private key, so it cannot vouch for weights: not for a refit it
sends in a policy rank's place, not for a seed it offers, not for a delta.

The payload is plain bytes built here (no pickle): a domain tag, the manifest's JSON and
one line per bucket.  Sealing and verifying cost well under a millisecond per refit
(``bench/signed_refit.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from pydantic import Field

from refit_worker.contract.keys import fingerprint

from .wire import B64Bytes, Manifest, _Model

#: Bytes of an Ed25519 private seed, public key and signature.
SEED_BYTES = KEY_BYTES = 32
SIGNATURE_BYTES = 64
_DOMAIN = b"kube-refit seal 1\n"


class SignatureError(RuntimeError):
    """A refit (or seed) is unsigned, or its signature does not verify with the job's key."""


def seal_payload(manifest: Manifest, digests: Iterable[tuple[int, Iterable[int]]]) -> bytes:
    """What a seal signs: the manifest as sent, then each bucket's piece hashes by ``seq``.

    Pydantic's JSON of a model is a pure function of its values, so the receiver's parsed
    copy gives the same bytes as the sender's.  The manifest already names the refit, so a
    seal of refit ``k`` never passes for refit ``k+1``."""
    lines = [_DOMAIN, manifest.model_dump_json().encode(), b"\n"]
    for seq, hashes in sorted(digests, key=lambda item: item[0]):
        lines.append(f"{seq}:{','.join(f'{h:016x}' for h in hashes)}\n".encode())
    return b"".join(lines)


class SealRecord(_Model):
    """One source's seal of a committed refit, kept with the state it sealed: a rank that
    offers its copy to peers forwards these, so a seeded peer checks the trainer's word
    for the bytes, not the seeding peer's."""

    manifest: Manifest
    #: Each bucket's piece hashes as this source sent them, by ``seq``.
    digests: tuple[tuple[int, tuple[int, ...]], ...]
    signature: B64Bytes = Field(min_length=SIGNATURE_BYTES, max_length=SIGNATURE_BYTES)
    key: str = Field(min_length=1, max_length=64)

    def payload(self) -> bytes:
        return seal_payload(self.manifest, self.digests)


class RefitSigner:
    """A policy rank's signing key (the job's private seed)."""

    def __init__(self, seed: bytes) -> None:
        if len(seed) != SEED_BYTES:
            raise ValueError(f"an Ed25519 seed has {SEED_BYTES} bytes, got {len(seed)}")
        self._key = Ed25519PrivateKey.from_private_bytes(seed)
        self.public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.fingerprint = fingerprint(self.public)

    @classmethod
    def generate(cls) -> RefitSigner:
        """A fresh key pair from the OS's randomness (tests, benchmarks)."""
        return cls(Ed25519PrivateKey.generate().private_bytes_raw())

    def sign(self, payload: bytes) -> bytes:
        return self._key.sign(payload)

    def __repr__(self) -> str:  # never the seed
        return f"RefitSigner({self.fingerprint})"


class RefitVerifier:
    """A rollout rank's copy of the job's public key."""

    def __init__(self, public: bytes) -> None:
        if len(public) != KEY_BYTES:
            raise ValueError(f"an Ed25519 public key has {KEY_BYTES} bytes, got {len(public)}")
        self._key = Ed25519PublicKey.from_public_bytes(public)
        self.fingerprint = fingerprint(public)

    def verify(self, payload: bytes, signature: bytes | None, who: str) -> None:
        """Raise :class:`SignatureError` unless ``signature`` is the job key's over
        ``payload``; ``who`` names the refit and its sender in the message."""
        if signature is None:
            raise SignatureError(
                f"{who}: unsigned, and this rank takes only refits signed with the job's key "
                f"{self.fingerprint}"
            )
        try:
            self._key.verify(signature, payload)
        except InvalidSignature:
            raise SignatureError(
                f"{who}: the signature does not verify with the job's key {self.fingerprint}: "
                "not the trainer's refit (forged, or altered on the way)"
            ) from None


__all__ = [
    "RefitSigner",
    "RefitVerifier",
    "SealRecord",
    "SignatureError",
    "fingerprint",
    "seal_payload",
]
