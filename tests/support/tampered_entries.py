"""The tampered-rendezvous corpus: one tampered value per row, and how each reader judges it.

Shared by ``tests/unit/test_badinput_rendezvous.py`` (which asserts every row's outcome)
and ``bench/reliability_badinput.py`` (which reports them).  Each row plants one tampered
value (another epoch, another pod's uid, garbage bytes, an oversized value, a pickle, a
misplaced entry) on top of an honest 1 policy + 1 rollout epoch 0, and both readers judge
it:

- the operator (:func:`refit_operator.core.coordinate.decide_barrier`, before the barrier opens):
  ``opened`` the barrier for the honest pods, ``rewritten`` a forged barrier into the
  honest one, ``waits``, or ``refused`` with a message;
- a worker (a real :class:`FileStore` on disk, after the barrier opened: snapshot,
  ``wait_barrier``, ``peers``, preemption notice): ``proceeds`` with the honest peers,
  ``waits`` (a 0.2 s wait that times out), or ``refused`` with a message.

The pickles are live: unpickling one creates a marker directory (:class:`Exploit`).
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.rendezvous_maps import spread

from refit_operator.core.coordinate import decide_barrier, decode, read_rendezvous
from refit_worker.contract.rendezvous import (
    BARRIER_KEY,
    MAX_META_BYTES,
    PREEMPT_KEY,
    PROTOCOL_VERSION,
    BarrierEntry,
    EntryError,
    Layout,
    LivePod,
    MetadataEntry,
    RolloutMember,
    encode_entry,
)
from refit_worker.rendezvous import FileStore, Member, Preempted
from refit_worker.rendezvous.store import RendezvousTimeout

P0, R0 = Member("policy", 0, 0, "p0"), Member("rollout", 0, 0, "r0")
AGENT = json.dumps({"agent_name": "a"})


class Exploit:
    """Unpickling this creates ``marker`` (a directory): proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[[str], None], tuple[str]]:
        return os.mkdir, (str(self.marker),)


def _json(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def _meta(
    epoch: int = 0,
    uid: str = "p0",
    role: str = "policy",
    rank: int = 0,
    agent: str = AGENT,
    generation: int = 0,
) -> bytes:
    return _json(
        v=PROTOCOL_VERSION,
        epoch=epoch,
        uid=uid,
        role=role,
        rank=rank,
        agent=agent,
        generation=generation,
    )


def _barrier(epoch: int, policy: list[str], rollout: list[str]) -> bytes:
    slots = [{"uid": uid, "generation": 0} for uid in rollout]
    return _json(v=PROTOCOL_VERSION, epoch=epoch, version=1, policy_uids=policy, rollout=slots)


def honest() -> dict[str, str]:
    """Epoch 0 with both ranks published (the operator has not opened the barrier yet)."""
    return {
        "meta.policy.0": encode_entry(
            "meta.policy.0", MetadataEntry(epoch=0, uid="p0", role="policy", rank=0, agent=AGENT)
        ),
        "meta.rollout.0": encode_entry(
            "meta.rollout.0", MetadataEntry(epoch=0, uid="r0", role="rollout", rank=0, agent=AGENT)
        ),
    }


HONEST_BARRIER = BarrierEntry(epoch=0, policy_uids=("p0",), rollout=(RolloutMember(uid="r0"),))


@dataclass(frozen=True)
class Tamper:
    """One tampered value and what each reader must make of it."""

    name: str
    key: str
    value: Callable[[Path], bytes]  # given the marker path a pickle would create
    operator: str  # "opened" | "rewritten" | "waits" | "refused: <words>" | "n/a"
    worker: str  # "proceeds" | "waits" | "preempted" | "refused: <words>"


def pickled(protocol: int) -> Callable[[Path], bytes]:
    """A live pickle (of :class:`Exploit`) in ``protocol``, for a marker path."""
    return lambda marker: pickle.dumps(Exploit(marker), protocol=protocol)


TAMPERED: list[Tamper] = [
    Tamper(
        "metadata of another epoch",
        "meta.policy.0",
        lambda m: _meta(epoch=5),
        "waits",
        "refused: 'meta.policy.0': missing for epoch 0, though the barrier lists it",
    ),
    Tamper(
        "barrier of another epoch",
        BARRIER_KEY,
        lambda m: _barrier(5, ["x"], ["y"]),
        "opened",
        "waits",
    ),
    Tamper(
        "preemption notice of another epoch",
        PREEMPT_KEY,
        lambda m: _json(v=PROTOCOL_VERSION, epoch=5, pod="p", uid="x", reason="old"),
        "opened",
        "proceeds",
    ),
    Tamper(
        "metadata from another pod",
        "meta.policy.0",
        lambda m: _meta(uid="intruder"),
        "refused: 'meta.policy.0': written by pod uid 'intruder', but the rank's pod is 'p0'",
        "refused: 'meta.policy.0': written by pod uid 'intruder', but the barrier recorded 'p0'",
    ),
    Tamper(
        "rollout metadata of another generation",
        "meta.rollout.0",
        lambda m: _meta(uid="r0", role="rollout", generation=1),
        "waits",
        "refused: 'meta.rollout.0': written by generation 1 of pod uid 'r0', "
        "but the barrier recorded generation 0",
    ),
    Tamper(
        "barrier naming another pod",
        BARRIER_KEY,
        lambda m: _barrier(0, ["intruder"], ["r0"]),
        "rewritten",
        "refused: lists pod uid 'intruder' for policy rank 0, but this pod is 'p0'",
    ),
    Tamper(
        "garbage bytes",
        "meta.rollout.0",
        lambda m: b"\xff\xfe\x00\x9cgarbage\x00",
        "refused: 'meta.rollout.0': value is not JSON",
        "refused: 'meta.rollout.0': value is not JSON",
    ),
    Tamper(
        "oversized metadata",
        "meta.policy.0",
        lambda m: _meta(agent=json.dumps({"pad": "x" * 6000})),
        f"refused: over the {MAX_META_BYTES}-byte limit",
        f"refused: over the {MAX_META_BYTES}-byte limit",
    ),
    Tamper(
        "16 MiB file",
        "progress.rollout.0",
        lambda m: b"{" + b" " * (16 << 20) + b"}",
        "n/a",
        "refused: 'progress.rollout.0': value is",
    ),
    Tamper(
        "pickle, protocol 0",
        "meta.policy.0",
        pickled(0),
        "refused: 'meta.policy.0': value is not JSON",
        "refused: 'meta.policy.0': value is not JSON",
    ),
    Tamper(
        "pickle, protocol 5",
        BARRIER_KEY,
        pickled(5),
        "refused: 'barrier': value is not JSON",
        "refused: 'barrier': value is not JSON",
    ),
    Tamper(
        "pickle inside the agent field",
        "meta.policy.0",
        lambda m: _meta(agent=pickled(0)(m).decode("latin-1")),
        "refused: agent metadata is not JSON",
        "refused: agent metadata is not JSON",
    ),
    Tamper(
        "JSON naming a reducer",
        PREEMPT_KEY,
        lambda m: _json(
            v=PROTOCOL_VERSION, epoch=0, pod="p", uid="u", reason="r", __reduce__="os.system"
        ),
        "refused: __reduce__: Extra inputs are not permitted",
        "refused: __reduce__: Extra inputs are not permitted",
    ),
    Tamper(
        "entry of another rank",
        "meta.policy.0",
        lambda m: _meta(role="rollout", uid="r0"),
        "refused: holds the entry of rollout rank 0",
        "refused: holds the entry of rollout rank 0",
    ),
    Tamper(
        "another protocol version",
        "meta.policy.0",
        lambda m: _json(
            v=PROTOCOL_VERSION + 1, epoch=0, uid="p0", role="policy", rank=0, agent=AGENT
        ),
        f"refused: protocol version {PROTOCOL_VERSION + 1}, this reader speaks {PROTOCOL_VERSION}",
        f"refused: protocol version {PROTOCOL_VERSION + 1}, this reader speaks {PROTOCOL_VERSION}",
    ),
    # Stale after a scale-down, say: ignored by both, not an error (protocol v3).
    Tamper(
        "rank outside the job",
        "meta.rollout.7",
        lambda m: _meta(rank=7, role="rollout"),
        "opened",
        "proceeds",
    ),
    Tamper("key outside the protocol", "annotations.evil", pickled(0), "opened", "proceeds"),
    Tamper(
        "barrier of another shape",
        BARRIER_KEY,
        lambda m: _barrier(0, ["p0", "p1"], ["r0"]),
        "refused: lists 2 policy ranks, the job has 1",
        "refused: lists 2 policy ranks, the job has 1",
    ),
    Tamper(
        "JSON list",
        "meta.rollout.0",
        lambda m: b"[1, 2]",
        "refused: value is a JSON list, not an object",
        "refused: value is a JSON list, not an object",
    ),
]


def operator_outcome(row: Tamper, marker: Path) -> str:
    """What the operator's coordinator makes of the honest epoch plus the tampered value."""
    if row.operator == "n/a":
        return "n/a"
    data = {**honest(), row.key: row.value(marker).decode("utf-8", errors="replace")}
    read = read_rendezvous(
        "job",
        decode(spread("job", data)),
        epoch=0,
        world=(1, 1),
        live={("policy", 0): LivePod("p0"), ("rollout", 0): LivePod("r0")},
    )
    result = decide_barrier(read)
    if result.problem is not None and not result.patches:
        return f"refused: {result.problem}"
    if not result.patches:
        return "waits"
    (patch,) = result.patches
    barrier = json.loads(patch.data[BARRIER_KEY] or "{}")
    honest_slots = [{"uid": "r0", "generation": 0}]
    if (barrier.get("policy_uids"), barrier.get("rollout")) != (["p0"], honest_slots):
        return f"ACCEPTED a barrier for {barrier}"
    # A forged barrier is replaced by the true one, and the status says so.
    return "rewritten" if result.problem is not None else "opened"


def worker_outcome(row: Tamper, marker: Path, directory: Path) -> str:
    """What policy rank 0 makes of it, through a real file store, once the barrier is open."""
    store = FileStore(directory, Layout(1, 1, 1))
    for key, value in {**honest(), BARRIER_KEY: encode_entry(BARRIER_KEY, HONEST_BARRIER)}.items():
        (directory / _shard_dir(store, key) / key).write_text(value)
    (directory / _shard_dir(store, row.key) / row.key).write_bytes(row.value(marker))
    try:
        barrier = store.wait_barrier(P0, timeout=0.2)
        peers = store.peers(P0, barrier)
        notice = store.preemption_notice(P0)
    except EntryError as exc:
        return f"refused: {exc}"
    except RendezvousTimeout:
        return "waits"
    except Preempted:
        return "preempted"
    finally:
        store.close()
    if {k: e.uid for k, e in peers.items()} != {("policy", 0): "p0", ("rollout", 0): "r0"}:
        return f"ACCEPTED peers {peers}"
    return "proceeds" if notice is None else f"ACCEPTED notice {notice}"


def _shard_dir(store: FileStore, key: str) -> str:
    """The folder ``key`` belongs in (a key outside the protocol: the operator's)."""
    try:
        return f"shard-{store.layout.shard_of(key)}"
    except (EntryError, ValueError):
        return "shard-0"
