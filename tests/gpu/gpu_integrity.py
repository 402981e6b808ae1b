"""The device integrity hash (``wsum64``) on CUDA memory.  Real: a CUDA device, a real
thread pool with its own stream.  Run by ``bench/gpu_check.sh``."""

from __future__ import annotations

import torch

from refit_worker.engine.messages.integrity import Hasher, as_bytes, hash_bytes


def test_device_hash_is_stable_and_sees_every_byte() -> None:
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device="cuda")
    first = hash_bytes(data, "wsum64")
    assert hash_bytes(data.clone(), "wsum64") == first
    for where in (0, 1, 2, 3, (3 << 20) - 1):  # every lane of a word, and the tail
        flipped = data.clone()
        flipped[where] ^= 1
        assert hash_bytes(flipped, "wsum64") != first, where
    swapped = data.clone()
    swapped[:4], swapped[4:8] = data[4:8].clone(), data[:4].clone()
    if not torch.equal(data[:4], data[4:8]):
        assert hash_bytes(swapped, "wsum64") != first


def test_unaligned_views_hash_like_their_copies() -> None:
    data = torch.randint(0, 256, (4099,), dtype=torch.uint8, device="cuda")
    view = data[1:4098]  # starts off a 4-byte boundary
    assert hash_bytes(view, "wsum64") == hash_bytes(view.clone(), "wsum64")


def test_pool_waits_for_the_ready_event_not_the_device() -> None:
    hasher = Hasher(1)
    try:
        source = torch.randn(1 << 20, device="cuda")
        target = torch.empty_like(source)
        target.copy_(source)  # queued on the current stream
        ready = torch.cuda.Event()
        ready.record()
        got = hasher.submit([as_bytes(target)], "wsum64", ready).result(timeout=60)
        assert got == (hash_bytes(as_bytes(source), "wsum64"),)
    finally:
        hasher.close()
