"""The receiver's guards, driven through real NIXL notifications and WRITEs.

Real: two NIXL agents (UCX) in this process, one per engine, exchanging real notifications
and real WRITEs.  To provoke a bad refit, the policy side's agent hand-crafts control
messages (a "rogue sender") instead of running ``send_weights``; nothing else is faked.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator

import pytest
import torch

from refit_worker.checkpoint_engines import (
    IncompleteRefitError,
    NIXLCheckpointEngine,
    PeerError,
    RefitTimeoutError,
    TensorMeta,
)
from refit_worker.checkpoint_engines.messages import (
    BucketReady,
    Manifest,
    ManifestEntry,
    encode,
)

BUCKET = 4096


@pytest.fixture
async def pair() -> AsyncIterator[tuple[NIXLCheckpointEngine, NIXLCheckpointEngine]]:
    policy = NIXLCheckpointEngine(BUCKET, device="cpu", timeout_s=2.0)
    rollout = NIXLCheckpointEngine(BUCKET, device="cpu", timeout_s=2.0)
    metadata = [policy.prepare().model_dump_json(), rollout.prepare().model_dump_json()]
    policy.init_policy_process_group(
        worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata
    )
    rollout.init_rollout_process_group(
        rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata
    )
    yield policy, rollout
    policy.finalize()
    rollout.finalize()


async def collect(rollout: NIXLCheckpointEngine, **kw: int) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    async for batch in rollout.receive_weight_batches(**kw):
        got.update((name, t.clone()) for name, t in batch)
    return got


async def test_round_trip_in_process(pair) -> None:
    policy, rollout = pair
    sd = {"w": torch.arange(3000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bool)}
    _, got = await asyncio.gather(policy.send_weights(iter(sd.items())), collect(rollout))
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    assert policy.refit_id == rollout.refit_id == 1


async def test_duplicate_names_fail_before_anything_is_sent(pair) -> None:
    policy, rollout = pair
    t = torch.zeros(4)
    with pytest.raises(ValueError, match=r"duplicate tensor names: \['a'\]"):
        await policy.send_weights(iter([("a", t), ("b", t), ("a", t)]))
    await asyncio.sleep(0.2)
    assert rollout.agent.take_control(policy.agent.name, "manifest", 0) is None


async def test_stale_notifications_of_an_earlier_refit_are_never_taken(pair) -> None:
    policy, rollout = pair
    old = {"w": torch.full((10,), 1.0)}
    new = {"w": torch.full((10,), 2.0)}
    await asyncio.gather(policy.send_weights(iter(old.items())), collect(rollout))
    # Late copies of refit 0's messages arrive while refit 1 is running.
    stale = encode(
        Manifest(
            refit=0,
            total_buckets=1,
            digest="x",
            tensors=(ManifestEntry(name="w", dtype="float32", shape=(10,)),),
        )
    )
    receiving = asyncio.ensure_future(collect(rollout))
    await asyncio.sleep(0.05)
    policy.agent._agent.send_notif(rollout.agent.name, stale)
    _, got = await asyncio.gather(policy.send_weights(iter(new.items())), receiving)
    assert torch.equal(got["w"], new["w"])


async def rogue_refit(
    policy: NIXLCheckpointEngine,
    rollout: NIXLCheckpointEngine,
    entries: list[ManifestEntry],
    pieces: list[TensorMeta],
    data: torch.Tensor,
) -> None:
    """Send a hand-made manifest and one bucket of ``data`` as the policy rank would."""
    agent, peer = policy.agent, rollout.agent.name
    target = policy._targets[0]
    deadline = time.monotonic() + 2
    await agent.wait_control(peer, "credit", 0, 0, what="credit", deadline=deadline)
    agent.send_control(peer, Manifest(refit=0, total_buckets=1, digest="d", tensors=tuple(entries)))
    handle_reg = agent.register([(data.data_ptr(), data.numel(), 0)], "DRAM")
    message = BucketReady(
        refit=0, seq=0, buffer=0, total_buckets=1, digest="d", pieces=tuple(pieces)
    )
    handle = agent.post_write(
        peer,
        [(data.data_ptr(), data.numel(), 0)],
        [(target.buffers[0].addr, data.numel(), 0)],
        "DRAM",
        encode(message),
    )
    await agent.wait_transfer(handle, peer, "rogue bucket", deadline)
    agent.deregister(handle_reg)


def piece(name: str, n: int, offset: int = 0) -> TensorMeta:
    return TensorMeta(
        name=name, shape=(n,), dtype="uint8", chunk_offset=0, chunk_size=n, offset=offset
    )


def entry(name: str, n: int, checksum: int | None = None) -> ManifestEntry:
    return ManifestEntry(name=name, dtype="uint8", shape=(n,), checksum=checksum)


@pytest.mark.parametrize(
    ("entries", "pieces", "match"),
    [
        ([entry("a", 8), entry("b", 8)], [piece("a", 8)], r"ended without 1 tensor\(s\): b"),
        ([entry("a", 8)], [piece("a", 8), piece("a", 8, 8)], "'a' arrived twice"),
        ([entry("a", 8)], [piece("a", 8), piece("zzz", 8, 8)], "'zzz' is not in the manifest"),
        ([entry("a", 8, checksum=12345)], [piece("a", 8)], "'a' failed its checksum"),
        ([entry("a", 4)], [piece("a", 8)], r"bucket says uint8\[8\], manifest says uint8\[4\]"),
    ],
    ids=["missing", "duplicate", "extra", "checksum", "shape-mismatch"],
)
async def test_incomplete_refit_raises_before_the_final_batch(pair, entries, pieces, match) -> None:
    policy, rollout = pair
    data = torch.arange(16, dtype=torch.uint8)
    yielded: list[object] = []

    async def receive() -> None:
        async for batch in rollout.receive_weight_batches():
            yielded.append(batch)

    with pytest.raises(IncompleteRefitError, match=match):
        await asyncio.gather(receive(), rogue_refit(policy, rollout, entries, pieces, data))
    assert yielded == [], "a refit that fails its manifest must not yield its final batch"
    await asyncio.sleep(0.1)
    with pytest.raises(PeerError, match="aborted refit 0: rollout rank 0"):
        policy.agent.take_control(rollout.agent.name, "done", 0)


async def test_receiver_abort_reaches_the_sender(pair) -> None:
    policy, rollout = pair
    w = {"w": torch.zeros(3)}
    await asyncio.gather(policy.send_weights(iter(w.items())), collect(rollout))
    # Abort is best effort over an established connection (else the sender's timeout acts).
    rollout.agent.abort(policy.agent.name, 1, "disk full")
    with pytest.raises(PeerError, match="aborted refit 1: disk full"):
        await policy.send_weights(iter([("w", torch.zeros(3))]))


async def test_checksums_pass_when_data_is_right(pair) -> None:
    policy, rollout = pair
    data = torch.arange(16, dtype=torch.uint8)
    crc = zlib.crc32(data[:8].numpy().tobytes())
    got: list[tuple[str, torch.Tensor]] = []

    async def receive() -> None:
        async for batch in rollout.receive_weight_batches():
            got.extend((n, t.clone()) for n, t in batch)

    await asyncio.gather(
        receive(), rogue_refit(policy, rollout, [entry("a", 8, crc)], [piece("a", 8)], data)
    )
    assert [n for n, _ in got] == ["a"] and torch.equal(got[0][1], data[:8])


async def test_silent_sender_times_out_naming_what_was_awaited(pair) -> None:
    _, rollout = pair
    started = time.monotonic()
    with pytest.raises(RefitTimeoutError, match=r"the manifest of refit 0 \(policy rank 0"):
        await collect(rollout)
    assert time.monotonic() - started < 2.0 + 1.5


async def test_sender_without_receiver_credit_times_out(pair) -> None:
    policy, _ = pair
    with pytest.raises(RefitTimeoutError, match="credit for bucket 0 from rollout rank 0"):
        await policy.send_weights(iter([("w", torch.zeros(3))]))


async def test_big_tensors_land_in_last_refits_memory_and_stay_bit_exact(pair, monkeypatch) -> None:
    policy, rollout = pair
    seen: list[dict[str, tuple[int, torch.Tensor]]] = []
    landed: list[set[str]] = []
    take = rollout.agent.take_control

    def spy(peer: str, kind: str, refit: int, seq: int = 0) -> object:
        found = take(peer, kind, refit, seq)
        if isinstance(found, BucketReady):
            landed[-1].update(found.landed)
        return found

    monkeypatch.setattr(rollout.agent, "take_control", spy)

    async def receive() -> None:
        got: dict[str, tuple[int, torch.Tensor]] = {}
        async for batch in rollout.receive_weight_batches():
            got.update((name, (t.data_ptr(), t.clone())) for name, t in batch)
        seen.append(got)

    refits = [
        {"big": torch.arange(3000, dtype=torch.float32), "gone": torch.ones(2000)},
        {"big": torch.arange(3000, dtype=torch.float32) + 1, "w": torch.ones(5)},
        {"big": torch.arange(4000, dtype=torch.float32) * 2},  # resized: not offered, copied
        {"big": torch.arange(4000, dtype=torch.float32) * 3},
    ]
    for sd in refits:
        landed.append(set())
        await asyncio.gather(policy.send_weights(iter(sd.items())), receive())
    for sd, got in zip(refits, seen, strict=True):
        assert got.keys() == sd.keys() and all(torch.equal(got[k][1], sd[k]) for k in sd)
    assert landed == [set(), {"big"}, set(), {"big"}]
    assert seen[0]["big"][0] == seen[1]["big"][0], "refit 1 must reassemble in refit 0's memory"
    assert rollout._staging is not None and rollout._staging.names() == {"big"}
    rollout.finalize()
    assert rollout._staging is None


async def test_chunks_landed_in_memory_the_receiver_did_not_offer_are_refused(pair) -> None:
    policy, rollout = pair
    agent, peer = policy.agent, rollout.agent.name
    deadline = time.monotonic() + 2

    async def rogue() -> None:
        await agent.wait_control(peer, "credit", 0, 0, what="credit", deadline=deadline)
        agent.send_control(
            peer, Manifest(refit=0, total_buckets=1, digest="d", tensors=(entry("a", 8),))
        )
        agent.send_control(
            peer,
            BucketReady(
                refit=0,
                seq=0,
                buffer=0,
                total_buckets=1,
                digest="d",
                pieces=(piece("a", 8),),
                landed=("a",),
            ),
        )

    with pytest.raises(IncompleteRefitError, match="'a' landed in memory this rank did not"):
        await asyncio.gather(collect(rollout), rogue())
