"""The receiver's guards, driven through real NIXL notifications and WRITEs.

Real: two NIXL agents (UCX) in this process, one per engine, exchanging real notifications
and real WRITEs.  To provoke a bad refit, the policy side's agent hand-crafts control
messages (a "rogue sender") instead of running ``send_weights``; nothing else is faked.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import pytest
import torch
import xxhash

from refit_worker.engine import (
    IncompleteRefitError,
    LayoutMismatchError,
    NIXLCheckpointEngine,
    PeerError,
    RefitTimeoutError,
    RefitTiming,
    TensorSpec,
)
from refit_worker.engine.messages.signing import RefitSigner, RefitVerifier, seal_payload
from refit_worker.engine.messages.wire import (
    BucketReady,
    Digest,
    Manifest,
    ManifestEntry,
    Ready,
    Seal,
    encode,
)
from refit_worker.engine.planning.buckets import plan_digest

BUCKET = 4096


@pytest.fixture(params=[False], ids=["unchecked"])
async def pair(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[NIXLCheckpointEngine, NIXLCheckpointEngine]]:
    """A policy and a rollout engine; ``request.param``: both check integrity hashes."""
    checksum: bool = request.param
    async for engines in connected({"checksum": checksum}, {"checksum": checksum}):
        yield engines


async def connected(
    policy_kw: dict[str, Any], rollout_kw: dict[str, Any]
) -> AsyncIterator[tuple[NIXLCheckpointEngine, NIXLCheckpointEngine]]:
    """One policy and one rollout engine in one group (``*_kw``: each one's options)."""
    policy = NIXLCheckpointEngine(BUCKET, device="cpu", timeout_s=2.0, **policy_kw)
    rollout = NIXLCheckpointEngine(BUCKET, device="cpu", timeout_s=2.0, **rollout_kw)
    metadata = [policy.prepare().model_dump_json(), rollout.prepare().model_dump_json()]
    policy.init_policy_process_group(
        worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata
    )
    rollout.init_rollout_process_group(
        rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata
    )
    try:
        yield policy, rollout
    finally:
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
    assert policy.common.refit_id == rollout.common.refit_id == 1


async def test_upstream_message_api_carries_json_objects(pair) -> None:
    """``send_message`` / ``read_message``, upstream's NixlAgent API: JSON objects, oldest
    first; other notifications (a bare key, a JSON list) are not taken for messages."""
    policy, rollout = pair
    sender, receiver = policy.common.agent, rollout.common.agent
    sender._agent.send_notif(receiver.name, b"[1, 2]")
    sender.send_message(receiver.name, {"step": 1, "names": ["w"]})
    sender.send_message(receiver.name, {"step": 2})

    async def pump() -> None:  # no progress thread: only polls move the sender's queue
        while True:
            sender.poll()
            await asyncio.sleep(0.005)

    pumping = asyncio.ensure_future(pump())
    try:
        first = await receiver.read_message(sender.name, timeout=30)
        second = await receiver.read_message(sender.name, timeout=30)
        with pytest.raises(RefitTimeoutError, match="a message from"):
            await receiver.read_message(sender.name, timeout=0.2)
    finally:
        pumping.cancel()
    assert (first, second) == ({"step": 1, "names": ["w"]}, {"step": 2})


async def test_each_side_returns_what_its_refit_cost(pair) -> None:
    policy, rollout = pair
    sd = {"w": torch.arange(3000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bool)}
    timings: list[RefitTiming] = []

    async def drain() -> None:
        before = len(timings)
        async for _batch in rollout.receive_weight_batches(on_complete=timings.append):
            assert len(timings) == before, "reported before the last batch was taken"

    for k in range(2):
        sent, _ = await asyncio.gather(policy.send_weights(iter(sd.items())), drain())
        assert (sent.refit_id, sent.role, sent.bytes) == (k, "policy", 3000 * 4 + 3)
    assert [(t.refit_id, t.role, t.bytes) for t in timings] == [
        (0, "rollout", 12003),
        (1, "rollout", 12003),
    ]
    assert all(t.seconds > 0 for t in timings)


async def test_duplicate_names_fail_before_anything_is_sent(pair) -> None:
    policy, rollout = pair
    t = torch.zeros(4)
    with pytest.raises(ValueError, match=r"duplicate tensor names: \['a'\]"):
        await policy.send_weights(iter([("a", t), ("b", t), ("a", t)]))
    await asyncio.sleep(0.2)
    assert rollout.common.agent.take_control(policy.common.agent.name, "manifest", 0) is None


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
            bucket_size=BUCKET,
            tensors=(ManifestEntry(name="w", dtype="float32", shape=(10,)),),
        )
    )
    receiving = asyncio.ensure_future(collect(rollout))
    await asyncio.sleep(0.05)
    policy.common.agent._agent.send_notif(rollout.common.agent.name, stale)
    _, got = await asyncio.gather(policy.send_weights(iter(new.items())), receiving)
    assert torch.equal(got["w"], new["w"])


def entry(name: str, n: int, dtype: str = "uint8") -> ManifestEntry:
    return ManifestEntry(name=name, dtype=dtype, shape=(n,))


def xxh(data: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(data.numpy().tobytes())


async def rogue_refit(
    policy: NIXLCheckpointEngine,
    rollout: NIXLCheckpointEngine,
    entries: list[ManifestEntry],
    data: torch.Tensor,
    *,
    digest: str | None = None,
    integrity: str | None = None,
    hashes: tuple[int, ...] = (),
    buffer: int = 0,
    signer: RefitSigner | None = None,
    claim: str | None = None,
) -> None:
    """Play a policy rank by hand: manifest, wait for ready and a credit, WRITE one bucket
    of ``data`` into receive buffer 0, then (with ``integrity``) its digest, then (with
    ``signer``) a seal of both.  ``claim``: the key fingerprint the manifest names (default:
    the signer's)."""
    agent, peer = policy.common.agent, rollout.common.agent.name
    target = policy._target(0)
    deadline = time.monotonic() + 2
    specs = [TensorSpec(e.name, e.dtype, e.shape) for e in entries]
    manifest = Manifest(
        refit=0,
        total_buckets=1,
        digest=digest or plan_digest(specs, BUCKET),
        bucket_size=BUCKET,
        integrity=integrity,  # type: ignore[arg-type]
        tensors=tuple(entries),
        sealed_by=claim or (signer.fingerprint if signer else None),
    )
    agent.send_control(peer, manifest)
    ready = await agent.wait_control(peer, "ready", 0, 0, what="ready", deadline=deadline)
    assert isinstance(ready, Ready) and ready.landing is None  # small tensors: buffered
    await agent.wait_control(peer, "credit", 0, 0, what="credit", deadline=deadline)
    handle_reg = agent.register([(data.data_ptr(), data.numel(), 0)], "DRAM")
    message = BucketReady(refit=0, seq=0, buffer=buffer, digest=manifest.digest)
    # The engine's own WRITE path: prepared once, posted with the bucket's notification.
    prepared = agent.prepare_writes(
        peer,
        [(data.data_ptr(), data.numel(), 0)],
        [(target.buffers[0].addr, data.numel(), 0)],
        "DRAM",
        [[0]],
    )
    try:
        agent.post_prepared(prepared.handles[0], peer, encode(message))
        await agent.wait_posted(prepared.handles[0], peer, "rogue bucket", deadline)
    finally:
        prepared.release()
    agent.deregister(handle_reg)
    if integrity:
        agent.send_control(peer, Digest(refit=0, seq=0, hashes=hashes))
    if signer is not None:
        payload = seal_payload(manifest, [(0, hashes)] if integrity else [])
        key = manifest.sealed_by or signer.fingerprint
        agent.send_control(peer, Seal(refit=0, signature=signer.sign(payload), key=key))


async def first_error(receive: Awaitable[object], rogue: Awaitable[None]) -> BaseException:
    """Run the receiver against a rogue sender; the receiver's error (the rogue may hang)."""
    rogue_task = asyncio.ensure_future(rogue)
    try:
        await receive
    except BaseException as exc:
        return exc
    finally:
        rogue_task.cancel()
        await asyncio.gather(rogue_task, return_exceptions=True)
    raise AssertionError("the receiver accepted a bad refit")


DATA = torch.arange(16, dtype=torch.uint8)


@pytest.mark.parametrize(
    ("entries", "kw", "match"),
    [
        ([entry("a", 8), entry("b", 8)], {"digest": "x"}, r"plan into 1 buckets .* says 1"),
        ([entry("a", 8), entry("a", 8)], {"digest": "d"}, r"duplicate tensor names: \['a'\]"),
        ([entry("a", 8, "complex64")], {"digest": "d"}, "unknown dtype name 'complex64'"),
        ([entry("a", 8)], {"buffer": 1}, "bucket 0 went to buffer 1, expected 0"),
        (
            [entry("a", 8), entry("b", 8)],
            {"integrity": "xxh3_64", "hashes": (xxh(DATA[:8]), 12345)},
            r"tensor 'b' bytes 0..8 failed the xxh3_64 integrity check",
        ),
        ([entry("a", 8)], {"integrity": "wsum64"}, "'wsum64' does not fit memory on cpu"),
    ],
    ids=["plan-digest", "duplicate", "dtype", "wrong-buffer", "integrity", "wrong-hash-kind"],
)
async def test_bad_refit_raises_before_the_final_batch(pair, entries, kw, match) -> None:
    policy, rollout = pair
    yielded: list[object] = []

    async def receive() -> None:
        async for batch in rollout.receive_weight_batches():
            yielded.append(batch)

    error = await first_error(receive(), rogue_refit(policy, rollout, entries, DATA, **kw))
    assert isinstance(error, IncompleteRefitError), error
    assert error.args and re.search(match, str(error)), str(error)
    assert yielded == [], "a refit that fails its checks must not yield its final batch"
    await asyncio.sleep(0.1)
    with pytest.raises(PeerError, match="aborted refit 0: rollout rank 0"):
        policy.common.agent.take_control(rollout.common.agent.name, "done", 0)


async def test_integrity_passes_when_the_bytes_are_right(pair) -> None:
    got = await consistent_refit(*pair)
    assert list(got) == ["a", "b"] and torch.equal(got["b"], DATA[8:])


async def test_receiver_abort_reaches_the_sender(pair) -> None:
    policy, rollout = pair
    w = {"w": torch.zeros(3)}
    await asyncio.gather(policy.send_weights(iter(w.items())), collect(rollout))
    # Abort is best effort over an established connection (else the sender's timeout acts).
    rollout.common.agent.abort(policy.common.agent.name, 1, "disk full")
    timing = await policy.send_weights(iter([("w", torch.zeros(3))]))
    assert timing.delivered == () and "aborted refit 1: disk full" in timing.dropped[0], timing


async def test_silent_sender_times_out_naming_what_was_awaited(pair) -> None:
    _, rollout = pair
    started = time.monotonic()
    with pytest.raises(RefitTimeoutError, match=r"the manifest \(policy rank 0, within 2.0s\)"):
        await collect(rollout)
    assert time.monotonic() - started < 2.0 + 1.5


async def test_sender_without_a_ready_receiver_times_out(pair) -> None:
    policy, _ = pair
    started = time.monotonic()
    timing = await policy.send_weights(iter([("w", torch.zeros(3))]))
    assert timing.delivered == () and timing.bytes == 0, timing
    assert "RefitTimeoutError" in timing.dropped[0], timing
    assert "readiness for refit 0 from rollout rank 0" in timing.dropped[0], timing
    assert time.monotonic() - started < 2.0 + 1.5


async def test_big_tensors_land_in_kept_memory_from_the_first_refit(pair) -> None:
    policy, rollout = pair
    seen: list[dict[str, tuple[int, torch.Tensor]]] = []

    async def receive() -> None:
        got: dict[str, tuple[int, torch.Tensor]] = {}
        async for batch in rollout.receive_weight_batches():
            got.update((name, (t.data_ptr(), t.clone())) for name, t in batch)
        seen.append(got)

    refits = [
        {"big": torch.arange(3000, dtype=torch.float32), "gone": torch.ones(2000)},
        {"big": torch.arange(3000, dtype=torch.float32) + 1, "w": torch.ones(5)},
        {"big": torch.arange(4000, dtype=torch.float32) * 2},  # resized: new memory
        {"big": torch.arange(4000, dtype=torch.float32) * 3},
    ]
    for sd in refits:
        await asyncio.gather(policy.send_weights(iter(sd.items())), receive())
    for sd, got in zip(refits, seen, strict=True):
        assert got.keys() == sd.keys() and all(torch.equal(got[k][1], sd[k]) for k in sd)
    staged = rollout._kept.staging
    assert staged is not None and staged.names() == {"big"}
    assert seen[0]["big"][0] == seen[1]["big"][0], "refit 1 must reassemble in refit 0's memory"
    assert seen[2]["big"][0] == seen[3]["big"][0] == staged.tensors()["big"].data_ptr()
    rollout.finalize()
    assert rollout._kept.staging is None


async def test_receive_into_lands_in_the_targets_and_registers_once(pair) -> None:
    policy, rollout = pair
    targets = {"w": torch.empty(3000), "b": torch.empty(3, dtype=torch.bool), "e": torch.empty(0)}
    registrations = []
    for k in range(3):
        sd = {
            "w": torch.arange(3000.0) * k,
            "b": torch.ones(3, dtype=torch.bool),
            "e": torch.zeros(0),
        }
        pointers = {n: t.data_ptr() for n, t in targets.items()}
        sent, got = await asyncio.gather(
            policy.send_weights(iter(sd.items())), rollout.receive_into(targets)
        )
        assert got.tensors is targets
        assert {n: t.data_ptr() for n, t in targets.items()} == pointers
        assert all(torch.equal(targets[n], sd[n]) for n in sd)
        assert (got.timing.refit_id, got.timing.role, got.timing.bytes) == (k, "rollout", 12003)
        assert (sent.refit_id, sent.role, sent.bytes) == (k, "policy", 12003)
        assert got.timing.seconds > 0 and sent.seconds > 0
        registrations.append(got.timing.registrations)
    assert registrations[0] >= 1 and registrations[1:] == [0, 0]


@pytest.mark.parametrize(
    ("targets", "match"),
    [
        ({"w": torch.zeros(10)}, r"sent but not in the target: b"),
        (
            {"w": torch.zeros(10), "b": torch.zeros(3), "x": torch.zeros(1)},
            r"in the target but not sent: x",
        ),
        (
            {"w": torch.zeros(11), "b": torch.zeros(3)},
            r"'w': sent float32\[10\], target has float32\[11\]",
        ),
        ({"w": torch.zeros(10), "b": torch.zeros(3, dtype=torch.int32)}, r"'b': sent float32\[3\]"),
        (
            {"w": torch.zeros(10, 2)[:, 0], "b": torch.zeros(3)},
            r"'w': the target tensor is not contig",
        ),
    ],
    ids=["missing", "extra", "shape", "dtype", "not-contiguous"],
)
async def test_layout_mismatch_is_refused_before_any_byte_lands(pair, targets, match) -> None:
    policy, rollout = pair
    before = {n: t.clone() for n, t in targets.items()}
    sd = {"w": torch.ones(10), "b": torch.ones(3)}
    sent, received = await asyncio.gather(
        policy.send_weights(iter(sd.items())), rollout.receive_into(targets), return_exceptions=True
    )
    assert isinstance(received, LayoutMismatchError), received
    assert re.search(match, str(received)), str(received)
    assert "nothing was written" in str(received)
    # The target's failure is not the sender's: it is dropped from the refit, with why.
    assert isinstance(sent, RefitTiming) and sent.delivered == (), sent
    assert "LayoutMismatchError" in sent.dropped[0], sent
    assert all(torch.equal(targets[n], before[n]) for n in targets)
    assert not rollout.targets_exposed


def test_registry_registers_a_storage_once_and_drops_what_refits_stop_using(pair) -> None:
    from refit_worker.engine.transport.registry import MemoryRegistry

    _, rollout = pair
    registry = MemoryRegistry(rollout.common.agent, "DRAM")
    big = torch.zeros(4096)
    a, b = big[:2048], big[2048:]  # two views of one storage: one registration
    other = torch.zeros(10)
    registry.next_refit()
    first = registry.landing_set({"a": a, "b": b, "o": other})
    assert len(registry) == 2 and registry.registered == 2
    assert {t.name: t.addr for t in first.tensors} == {
        "a": a.data_ptr(),
        "b": b.data_ptr(),
        "o": other.data_ptr(),
    }
    assert first.metadata  # NIXL's partial metadata, for peers connected earlier
    registry.next_refit()
    assert registry.landing_set({"a": a, "b": b, "o": other}) is first  # cached
    assert registry.registered == 2
    registry.next_refit()
    registry.landing_set({"o": other})
    registry.sweep(keep=1)  # 'big' was not used by the last refit
    assert len(registry) == 1 and registry.serials([big, other])[0] == 0
    registry.next_refit()
    again = registry.landing_set({"a": a, "b": b, "o": other})
    assert again.id != first.id, "a storage registered again is a new landing set"
    registry.release(other)
    assert registry.serials([other]) == (0,)
    registry.clear()
    assert len(registry) == 0


async def test_buffered_buckets_hand_buffers_on_while_writes_need_progress(pair) -> None:
    """Between agents of one process UCX leaves WRITEs in progress until polled: the sender
    must drive them while it waits for credits, or the receiver never sees bucket 0."""
    policy, rollout = pair
    for refit in range(3):
        sd = {f"small.{i}": torch.full((300,), float(i + refit)) for i in range(12)}
        sd["big"] = torch.arange(5000, dtype=torch.float32) * refit  # > a bucket: lands
        _, got = await asyncio.gather(policy.send_weights(iter(sd.items())), collect(rollout))
        assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)


async def test_a_failed_refit_does_not_break_the_next_one(pair) -> None:
    policy, rollout = pair
    targets = {"w": torch.zeros(3000)}
    sd = {"w": torch.arange(3000.0)}
    await asyncio.gather(policy.send_weights(iter(sd.items())), rollout.receive_into(targets))
    # Refit 1 fails on the receiver's side after 'ready' (the sender is told to abort).
    wrong = {"w": torch.zeros(3000), "x": torch.zeros(1)}
    sent, received = await asyncio.gather(
        policy.send_weights(iter(sd.items())), rollout.receive_into(wrong), return_exceptions=True
    )
    assert isinstance(received, LayoutMismatchError), received
    assert isinstance(sent, RefitTiming) and sent.delivered == () and 0 in sent.dropped, sent
    sd = {"w": torch.arange(3000.0) * 2}
    await asyncio.gather(policy.send_weights(iter(sd.items())), rollout.receive_into(targets))
    assert torch.equal(targets["w"], sd["w"])


async def test_drop_target_stops_waiting_for_it_during_a_send(pair) -> None:
    policy, _ = pair  # the rollout never receives: without the drop, the wait times out
    assert policy.drop_target(0, "no send in progress") is False

    async def drop_soon() -> None:
        await asyncio.sleep(0.2)
        assert policy.drop_target(0, "left the membership (version 2)") is True

    timing, _ = await asyncio.gather(
        policy.send_weights(iter([("w", torch.zeros(3))])), drop_soon()
    )
    # The caller's reason, not the timeout's: the send stopped waiting when told to.
    assert timing.delivered == () and timing.dropped == {0: "left the membership (version 2)"}


@pytest.mark.parametrize("pair", [True], ids=["checked"], indirect=True)
async def test_a_manifest_without_hashes_is_refused_where_checksums_are_on(pair) -> None:
    """A sender that leaves the hashes out (as a forged one may) is refused, not taken
    unchecked under a ``checksums`` claim (issue #50)."""
    policy, rollout = pair
    error = await first_error(
        collect(rollout), rogue_refit(policy, rollout, [entry("a", 8), entry("b", 8)], DATA)
    )
    assert isinstance(error, IncompleteRefitError), error
    assert "carries no integrity hashes" in str(error) and "transfer.checksum" in str(error)


@pytest.mark.parametrize("pair", [False, True], ids=["unchecked", "checked"], indirect=True)
async def test_the_timing_says_whether_the_bytes_were_hashed(pair) -> None:
    """What a report may claim comes from what was checked of each refit."""
    policy, rollout = pair
    timings: list[RefitTiming] = []

    async def drain() -> None:
        async for _batch in rollout.receive_weight_batches(on_complete=timings.append):
            pass

    sd = {"w": torch.arange(300, dtype=torch.float32)}
    await asyncio.gather(policy.send_weights(iter(sd.items())), drain())
    assert [t.integrity for t in timings] == ["xxh3_64" if rollout.common.checksum else None]


# -- signed refits (issue #50): the trainer's key is the root of trust -------------------

JOB_KEY = RefitSigner.generate()


@pytest.fixture
async def signed_pair() -> AsyncIterator[tuple[NIXLCheckpointEngine, NIXLCheckpointEngine]]:
    """The job's policy rank (holding the private key) and a rollout rank (the public key)."""
    verifier = RefitVerifier(JOB_KEY.public)
    async for engines in connected(
        {"checksum": True, "signer": JOB_KEY}, {"checksum": True, "verifier": verifier}
    ):
        yield engines


async def test_a_signed_refit_lands_and_says_whose_key_it_passed(signed_pair) -> None:
    policy, rollout = signed_pair
    timings: list[RefitTiming] = []
    got: dict[str, torch.Tensor] = {}

    async def drain() -> None:
        async for batch in rollout.receive_weight_batches(on_complete=timings.append):
            got.update((n, t.clone()) for n, t in batch)

    # Several buckets, a tensor split over two: every piece's hash is under the seal.
    sd = {"w": torch.arange(3000, dtype=torch.float32), "b": torch.ones(7)}
    for _ in range(2):
        await asyncio.gather(policy.send_weights(iter(sd.items())), drain())
    assert torch.equal(got["w"], sd["w"]) and torch.equal(got["b"], sd["b"])
    assert [t.signed_by for t in timings] == [JOB_KEY.fingerprint] * 2


HOSTILE = RefitSigner.generate()  # a taken-over pod can make keys, not the job's


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({}, r"unsigned, and this rank takes only refits signed with the job's key ed25519:"),
        ({"signer": HOSTILE}, r"sealed with key ed25519:\w+, not the job's ed25519:"),
        (
            {"signer": HOSTILE, "claim": JOB_KEY.fingerprint},
            r"policy rank 0 .*: the signature does not verify with the job's key",
        ),
    ],
    ids=["unsigned", "own-key", "claims-the-jobs-key"],
)
async def test_a_forged_refit_with_consistent_hashes_is_refused(signed_pair, kw, match) -> None:
    """A hostile process in a policy rank's place sends weights of its own with hashes that
    match them: the hashes alone would pass; the seal does not."""
    policy, rollout = signed_pair
    yielded: list[object] = []

    async def receive() -> None:
        async for batch in rollout.receive_weight_batches():
            yielded.append(batch)

    error = await first_error(receive(), two_tensors(policy, rollout, **kw))
    assert isinstance(error, IncompleteRefitError), error
    assert re.search(match, str(error)), str(error)
    assert yielded == [], "a forged refit must not yield its final batch"


async def test_a_sealed_refit_with_altered_bytes_fails_their_hash(signed_pair) -> None:
    """The signer's own seal over hashes the bytes do not match: refused by the hash (the
    signature pins the hashes, the hashes the bytes)."""
    policy, rollout = signed_pair
    forged = two_tensors(policy, rollout, hashes=(xxh(DATA[:8]), xxh(DATA[:8])), signer=JOB_KEY)
    error = await first_error(collect(rollout), forged)
    assert re.search(r"tensor 'b' bytes 0..8 failed the xxh3_64 integrity check", str(error))


async def test_the_jobs_own_seal_passes_the_rogue_path(signed_pair) -> None:
    """The same hand-played sender with the job's key is taken: the refusals above are the
    key's doing, not the hand-played path's."""
    got = await consistent_refit(*signed_pair, signer=JOB_KEY)
    assert torch.equal(got["b"], DATA[8:])


async def consistent_refit(
    policy: NIXLCheckpointEngine, rollout: NIXLCheckpointEngine, **kw: Any
) -> dict[str, torch.Tensor]:
    """A hand-played refit of ``DATA`` as ``a`` and ``b`` whose hashes match its bytes."""
    got, _ = await asyncio.gather(collect(rollout), two_tensors(policy, rollout, **kw))
    return got


def two_tensors(
    policy: NIXLCheckpointEngine,
    rollout: NIXLCheckpointEngine,
    hashes: tuple[int, ...] = (xxh(DATA[:8]), xxh(DATA[8:])),
    **kw: Any,
) -> Awaitable[None]:
    """A hand-played refit of ``DATA`` as tensors ``a`` and ``b`` with ``hashes``."""
    entries = [entry("a", 8), entry("b", 8)]
    return rogue_refit(policy, rollout, entries, DATA, integrity="xxh3_64", hashes=hashes, **kw)
