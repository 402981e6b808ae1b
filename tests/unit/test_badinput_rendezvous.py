"""Tampered rendezvous entries are ignored or refused by name, never turned into code.

The rows (``tests/support/tampered_entries.py``) each plant one tampered value (another
epoch, another pod's uid, garbage bytes, an oversized value, a pickle, a misplaced entry)
on top of an honest 1 policy + 1 rollout epoch 0; the operator's coordinator and a worker
with a real file store judge it.  The pickles are live: unpickling one creates a marker
directory (the first test shows it does), and after every reader has seen them the marker
is still absent.

Real: the protocol, the file store and its files, the operator's coordinator, the NIXL
control-message and metadata decoders.  Nothing emulated.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError
from tests.support.tampered_entries import (
    TAMPERED,
    Exploit,
    Tamper,
    operator_outcome,
    pickled,
    worker_outcome,
)

from refit_worker.contract.rendezvous import PREEMPT_KEY, encode_entry, make_preempt_notice
from refit_worker.engine.messages.wire import NixlAgentMetadata, ProtocolError, decode


def _matches(outcome: str, expected: str) -> bool:
    if expected.startswith("refused: "):
        return outcome.startswith("refused: ") and expected[len("refused: ") :] in outcome
    return outcome == expected


def test_the_pickles_are_live(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    pickle.loads(pickled(5)(marker))  # the test's own payload, to prove it would run
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
        (lambda m: pickle.dumps(Exploit(m)), ProtocolError, "not a control message"),
        (lambda m: b"RFT1" + pickle.dumps(Exploit(m)), ProtocolError, "invalid control message"),
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
        NixlAgentMetadata.model_validate_json(pickle.dumps(Exploit(marker)))
    assert not marker.exists()


def test_a_notice_of_this_epoch_stops_the_worker(tmp_path: Path) -> None:
    # The control case for "preemption notice of another epoch": this epoch's is heeded.
    notice = encode_entry(PREEMPT_KEY, make_preempt_notice(0, "job-rollout-0", "r0", "drain"))
    row = Tamper("now", PREEMPT_KEY, lambda m: notice.encode(), "opened", "preempted")
    (tmp_path / "s").mkdir()
    assert worker_outcome(row, tmp_path / "m", tmp_path / "s") == "preempted"
