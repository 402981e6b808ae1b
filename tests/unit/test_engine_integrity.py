"""Integrity hashes (:mod:`refit_worker.engine.messages.integrity`).

Pure: hashes of in-memory tensors, a real thread pool; no NIXL.  The CUDA hash (``wsum64``)
is checked in ``tests/gpu/`` (run by ``bench/gpu_check.sh``).
"""

from __future__ import annotations

import threading

import pytest
import torch
import xxhash

from refit_worker.engine.messages.integrity import (
    Hasher,
    algorithm_for,
    as_bytes,
    hash_bytes,
)


def test_cpu_hash_is_xxh3_of_the_raw_bytes_without_a_copy() -> None:
    tensor = torch.randn(257, 3).to(torch.bfloat16)
    data = as_bytes(tensor)
    assert data.data_ptr() == tensor.data_ptr()  # a view, not a copy
    assert hash_bytes(data, "xxh3_64") == xxhash.xxh3_64_intdigest(
        tensor.view(torch.uint8).numpy().tobytes()
    )
    assert hash_bytes(data[:0], "xxh3_64") == xxhash.xxh3_64_intdigest(b"")


def test_any_flipped_bit_changes_the_hash() -> None:
    tensor = torch.arange(4096, dtype=torch.int32)
    before = hash_bytes(as_bytes(tensor), "xxh3_64")
    as_bytes(tensor)[5000] ^= 1
    assert hash_bytes(as_bytes(tensor), "xxh3_64") != before


def test_bad_inputs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="unknown integrity algorithm 'md5'"):
        hash_bytes(torch.zeros(4, dtype=torch.uint8), "md5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threads must be >= 1"):
        Hasher(0)


def test_algorithm_follows_the_memory() -> None:
    assert algorithm_for(torch.device("cpu")) == "xxh3_64"
    assert algorithm_for(torch.device("cuda", 0)) == "wsum64"


def test_hasher_runs_off_the_calling_thread_in_order() -> None:
    hasher = Hasher(2)
    threads: list[str] = []
    tensors = [torch.full((1000,), i, dtype=torch.uint8) for i in range(3)]
    try:
        original = hasher._run

        def spy(*args):  # type: ignore[no-untyped-def]
            threads.append(threading.current_thread().name)
            return original(*args)

        hasher._run = spy  # type: ignore[method-assign]
        future = hasher.submit([as_bytes(t) for t in tensors], "xxh3_64")
        want = tuple(xxhash.xxh3_64_intdigest(t.numpy().tobytes()) for t in tensors)
        assert future.result(timeout=10) == want
    finally:
        hasher.close()
    assert threads and all(name.startswith("refit-hash") for name in threads)
