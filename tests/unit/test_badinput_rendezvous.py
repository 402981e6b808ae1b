"""Tampered rendezvous entries are ignored or refused by name, never turned into code.

Each row plants one tampered value (another epoch, another pod's uid, garbage bytes, an
oversized value, a pickle, a misplaced entry) on top of an honest 1 policy + 1 rollout
epoch 0, and both readers judge it:

- the operator (:func:`refit_operator.coordinate.coordinate`, before the barrier opens):
  ``opened`` the barrier for the honest pods, ``waits``, or ``refused`` with a message;
- a worker (a real :class:`FileStore` on disk, after the barrier opened: snapshot,
  ``wait_barrier``, ``peers``, preemption notice): ``proceeds`` with the honest peers,
  ``waits`` (a 0.2 s wait that times out), or ``refused`` with a message.

The pickles are live: unpickling one creates a marker directory (the test shows it does),
and after every reader has seen them the marker is still absent.

Real: the protocol, the file store and its files, the operator's coordinator, the NIXL
control-message and metadata decoders.  Nothing emulated.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from refit_operator.coordinate import coordinate
from refit_worker.checkpoint_engines.messages import NixlAgentMetadata, ProtocolError, decode
from refit_worker.rendezvous import FileStore, Layout, Member, PreemptedError
from refit_worker.rendezvous.protocol import (
    BARRIER_KEY,
    PREEMPT_KEY,
    BarrierEntry,
    EntryError,
    MetadataEntry,
    encode_entry,
    make_preempt_notice,
)
from refit_worker.rendezvous.store import RendezvousTimeout

P0, R0 = Member("policy", 0, 0, "p0"), Member("rollout", 0, 0, "r0")
AGENT = json.dumps({"agent_name": "a"})


class _Exploit:
    """Unpickling this creates ``marker`` (a directory): proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[[str], None], tuple[str]]:
        return os.mkdir, (str(self.marker),)


def _json(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def _meta(
    epoch: int = 0, uid: str = "p0", role: str = "policy", rank: int = 0, agent: str = AGENT
) -> bytes:
    return _json(v=1, epoch=epoch, uid=uid, role=role, rank=rank, agent=agent)


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


HONEST_BARRIER = BarrierEntry(epoch=0, policy_uids=("p0",), rollout_uids=("r0",))


@dataclass(frozen=True)
class Tamper:
    """One tampered value and what each reader must make of it."""

    name: str
    key: str
    value: Callable[[Path], bytes]  # given the marker path a pickle would create
    operator: str  # "opened" | "waits" | "refused: <words>" | "n/a" (no ConfigMap holds it)
    worker: str  # "proceeds" | "waits" | "preempted" | "refused: <words>"


def _pickled(protocol: int) -> Callable[[Path], bytes]:
    return lambda marker: pickle.dumps(_Exploit(marker), protocol=protocol)


TAMPERED: list[Tamper] = [
    Tamper(
        "metadata of another epoch",
        "meta.policy.0",
        lambda m: _meta(epoch=5),
        "waits",
        "refused: 'meta.policy.0': missing for epoch 0, though the barrier is open",
    ),
    Tamper(
        "barrier of another epoch",
        BARRIER_KEY,
        lambda m: _json(v=1, epoch=5, policy_uids=["x"], rollout_uids=["y"]),
        "opened",
        "waits",
    ),
    Tamper(
        "preemption notice of another epoch",
        PREEMPT_KEY,
        lambda m: _json(v=1, epoch=5, pod="p", uid="x", reason="old"),
        "opened",
        "proceeds",
    ),
    Tamper(
        "metadata from another pod",
        "meta.policy.0",
        lambda m: _meta(uid="intruder"),
        "refused: 'meta.policy.0': written by pod uid 'intruder', but the rank's pod is 'p0'",
        "refused: 'meta.policy.0': written by pod uid 'intruder', but the barrier recorded",
    ),
    Tamper(
        "barrier naming another pod",
        BARRIER_KEY,
        lambda m: _json(v=1, epoch=0, policy_uids=["intruder"], rollout_uids=["r0"]),
        "waits",
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
        "refused: over the 5120-byte limit",
        "refused: over the 5120-byte limit",
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
        _pickled(0),
        "refused: 'meta.policy.0': value is not JSON",
        "refused: 'meta.policy.0': value is not JSON",
    ),
    Tamper(
        "pickle, protocol 5",
        BARRIER_KEY,
        _pickled(5),
        "refused: 'barrier': value is not JSON",
        "refused: 'barrier': value is not JSON",
    ),
    Tamper(
        "pickle inside the agent field",
        "meta.policy.0",
        lambda m: _meta(agent=_pickled(0)(m).decode("latin-1")),
        "refused: agent metadata is not JSON",
        "refused: agent metadata is not JSON",
    ),
    Tamper(
        "JSON naming a reducer",
        PREEMPT_KEY,
        lambda m: _json(v=1, epoch=0, pod="p", uid="u", reason="r", __reduce__="os.system"),
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
        lambda m: _json(v=2, epoch=0, uid="p0", role="policy", rank=0, agent=AGENT),
        "refused: protocol version 2, this reader speaks 1",
        "refused: protocol version 2, this reader speaks 1",
    ),
    Tamper(
        "rank outside the job",
        "meta.policy.7",
        lambda m: _meta(rank=7),
        "refused: rank 7 is outside the policy world size 1",
        "refused: rank 7 is outside the policy world size 1",
    ),
    Tamper("key outside the protocol", "annotations.evil", _pickled(0), "opened", "proceeds"),
    Tamper(
        "barrier of another shape",
        BARRIER_KEY,
        lambda m: _json(v=1, epoch=0, policy_uids=["p0", "p1"], rollout_uids=["r0"]),
        "refused: lists 2 policy and 1 rollout ranks",
        "refused: lists 2 policy and 1 rollout ranks",
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
    result = coordinate(
        "job",
        {"job-rendezvous": data},
        epoch=0,
        world=(1, 1),
        pod_uids={("policy", 0): "p0", ("rollout", 0): "r0"},
    )
    if result.problem is not None:
        return f"refused: {result.problem}"
    if not result.patches:
        return "waits"
    (patch,) = result.patches
    barrier = json.loads(patch.data[BARRIER_KEY] or "{}")
    if (barrier["policy_uids"], barrier["rollout_uids"]) != (["p0"], ["r0"]):
        return f"ACCEPTED a barrier for {barrier}"
    return "opened"


def worker_outcome(row: Tamper, marker: Path, directory: Path) -> str:
    """What policy rank 0 makes of it, through a real file store, once the barrier is open."""
    store = FileStore(directory, Layout(1, 1, 1))
    for key, value in {**honest(), BARRIER_KEY: encode_entry(BARRIER_KEY, HONEST_BARRIER)}.items():
        (directory / "shard-0" / key).write_text(value)
    (directory / "shard-0" / row.key).write_bytes(row.value(marker))
    try:
        barrier = store.wait_barrier(P0, timeout=0.2)
        peers = store.peers(P0, barrier)
        notice = store.preemption_notice(P0)
    except EntryError as exc:
        return f"refused: {exc}"
    except RendezvousTimeout:
        return "waits"
    except PreemptedError:
        return "preempted"
    finally:
        store.close()
    if {k: e.uid for k, e in peers.items()} != {("policy", 0): "p0", ("rollout", 0): "r0"}:
        return f"ACCEPTED peers {peers}"
    return "proceeds" if notice is None else f"ACCEPTED notice {notice}"


def _matches(outcome: str, expected: str) -> bool:
    if expected.startswith("refused: "):
        return outcome.startswith("refused: ") and expected[len("refused: ") :] in outcome
    return outcome == expected


def test_the_pickles_are_live(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    pickle.loads(_pickled(5)(marker))  # the test's own payload, to prove it would run
    assert marker.is_dir()


@pytest.mark.parametrize("row", TAMPERED, ids=lambda r: r.name)
def test_tampered_entry_is_ignored_or_refused(row: Tamper, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    (tmp_path / "store").mkdir()
    got = operator_outcome(row, marker), worker_outcome(row, marker, tmp_path / "store")
    assert _matches(got[0], row.operator), f"operator: {got[0]}"
    assert _matches(got[1], row.worker), f"worker: {got[1]}"
    assert not marker.exists(), "a pickle was loaded"


@pytest.mark.parametrize(
    ("raw", "error", "words"),
    [
        (lambda m: pickle.dumps(_Exploit(m)), ProtocolError, "not a control message"),
        (lambda m: b"RFT1" + pickle.dumps(_Exploit(m)), ProtocolError, "invalid control message"),
        (
            lambda m: b'RFT1{"v":2,"kind":"credit","refit":0,"seq":0,"buffer":0,"x":1}',
            ProtocolError,
            "invalid control message",
        ),
    ],
    ids=["pickle", "framed pickle", "extra field"],
)
def test_nixl_notifications_refuse_pickles(
    raw: Callable[[Path], bytes], error: type, words: str, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(error, match=words):
        decode(raw(marker))
    assert not marker.exists()


def test_agent_metadata_refuses_a_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(ValidationError):
        NixlAgentMetadata.model_validate_json(pickle.dumps(_Exploit(marker)))
    assert not marker.exists()


def test_a_notice_of_this_epoch_stops_the_worker(tmp_path: Path) -> None:
    # The control case for "preemption notice of another epoch": this epoch's is heeded.
    notice = encode_entry(PREEMPT_KEY, make_preempt_notice(0, "job-rollout-0", "r0", "drain"))
    row = Tamper("now", PREEMPT_KEY, lambda m: notice.encode(), "opened", "preempted")
    (tmp_path / "s").mkdir()
    assert worker_outcome(row, tmp_path / "m", tmp_path / "s") == "preempted"
