"""The receive path's own hashes stand in for a commit's offer only where they read the
committed memory; anything else is hashed afresh (``engine/messages/known_hashes``)."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from refit_worker.engine.base import TensorMeta
from refit_worker.engine.messages.integrity import Hasher, as_bytes, hash_bytes
from refit_worker.engine.messages.known_hashes import KnownHashes, tensor_hashes

ALG = "xxh3_64"


def _piece(name: str, t: torch.Tensor, chunk: tuple[int, int] | None = None) -> TensorMeta:
    nbytes = t.numel() * t.element_size()
    offset, size = chunk or (0, nbytes)
    return TensorMeta(
        name=name,
        shape=tuple(t.shape),
        dtype="float32",
        chunk_offset=offset,
        chunk_size=size,
        offset=0,
    )


def _done(*values: int) -> Future[tuple[int, ...]]:
    future: Future[tuple[int, ...]] = Future()
    future.set_result(values)
    return future


def test_a_verified_whole_piece_is_the_tensors_hash_and_nothing_is_hashed_again() -> None:
    a, b = torch.arange(8, dtype=torch.float32), torch.ones(4, dtype=torch.float32)
    memory = {"a": as_bytes(a), "b": as_bytes(b)}
    known = KnownHashes()
    # Values no hash of these bytes has: were the tensors hashed again, they would not show.
    known.verified([_piece("a", a), _piece("b", b)], _done(11, 22), memory, [True, True])
    assert tensor_hashes({"a": a, "b": b}, ALG, known.by_name) == {"a": 11, "b": 22}


def test_other_memory_a_split_piece_or_one_through_a_buffer_is_hashed_here() -> None:
    a, b, c = (torch.full((6,), float(i)) for i in range(3))
    memory = {"a": as_bytes(a), "b": as_bytes(b), "c": as_bytes(c)}
    known = KnownHashes()
    pieces = [_piece("a", a), _piece("b", b, (0, 8)), _piece("c", c)]
    known.verified(pieces, _done(1, 2, 3), memory, [True, True, False])
    assert set(known.by_name) == {"a"}
    moved = a.clone()  # the committed tensor is not the memory the hash read
    got = tensor_hashes({"a": moved, "b": b, "c": c}, ALG, known.by_name)
    assert got == {n: hash_bytes(as_bytes(t), ALG) for n, t in (("a", moved), ("b", b), ("c", c))}


def test_the_rest_is_hashed_whole_in_the_pool_and_a_failed_hash_is_redone() -> None:
    big, small = torch.randn(1 << 16), torch.randn(3)
    memory = {"big": as_bytes(big), "small": as_bytes(small)}
    known = KnownHashes()
    known.verified([_piece("small", small)], _done(7), memory, [True])
    hasher = Hasher(1)
    try:
        known.hash_the_rest(memory, hasher, ALG)
    finally:
        hasher.close()
    assert tensor_hashes({"big": big, "small": small}, ALG, known.by_name) == {
        "big": hash_bytes(as_bytes(big), ALG),
        "small": 7,
    }
    failed: Future[tuple[int, ...]] = Future()
    failed.set_exception(RuntimeError("pool shut down"))
    known.verified([_piece("small", small)], failed, memory, [True])
    assert tensor_hashes({"small": small}, ALG, known.by_name) == {
        "small": hash_bytes(as_bytes(small), ALG)
    }
