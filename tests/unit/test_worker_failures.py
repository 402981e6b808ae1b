"""How a failing worker is classified: the failure types, their exit codes, where they are
raised, and the one preemption exception.  Pure: exceptions in memory, files in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import refit_worker as session
import refit_worker.rendezvous as rendezvous
from refit_worker.contract.config import SafetensorsWeights
from refit_worker.contract.exits import EXIT_FAILED, EXIT_NOT_RETRYABLE, NOT_RETRYABLE
from refit_worker.contract.failures import (
    MissingWeightsError,
    NotRetryableError,
    RefusedConfigError,
    UnknownBackendError,
    UnsupportedWeightsError,
    exit_code_for,
    is_retryable,
    one_line,
)
from refit_worker.contract.rendezvous import Layout, make_preempt_notice
from refit_worker.pod.weights import load_safetensors
from refit_worker.rendezvous import FileStore, Member


def _caused_by(outer: Exception, cause: BaseException) -> Exception:
    try:
        raise outer from cause
    except Exception as exc:
        return exc


def _during(outer: Exception, context: BaseException) -> Exception:
    try:
        try:
            raise context
        except BaseException:
            raise outer  # noqa: B904 - an error while handling another, no "from"
    except Exception as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ValueError("bad"), EXIT_FAILED),
        (TimeoutError("peer gone"), EXIT_FAILED),
        (FileNotFoundError("no such file"), EXIT_FAILED),  # a builtin one may be transient
        (UnsupportedWeightsError("uint16"), EXIT_NOT_RETRYABLE),
        (MissingWeightsError("no dir"), EXIT_NOT_RETRYABLE),
        (UnknownBackendError("NOSUCH"), EXIT_NOT_RETRYABLE),
        (RefusedConfigError("releaseAfterRefit"), EXIT_NOT_RETRYABLE),
        (_caused_by(RuntimeError("wrapped"), UnknownBackendError("x")), EXIT_NOT_RETRYABLE),
        (
            _caused_by(RuntimeError("a"), _caused_by(ValueError("b"), MissingWeightsError("c"))),
            EXIT_NOT_RETRYABLE,
        ),
        # An error met while handling one is not caused by it: it may be transient.
        (_during(RuntimeError("cleanup"), MissingWeightsError("c")), EXIT_FAILED),
    ],
    ids=[
        "value",
        "timeout",
        "builtin-missing-file",
        "dtype",
        "missing-weights",
        "backend",
        "refused",
        "cause",
        "cause-of-cause",
        "context-only",
    ],
)
def test_exit_codes(exc: Exception, code: int) -> None:
    assert exit_code_for(exc) == code
    assert is_retryable(exc) is (code == EXIT_FAILED)


def test_the_not_retryable_code_fails_a_job_at_once() -> None:
    assert EXIT_NOT_RETRYABLE in NOT_RETRYABLE and EXIT_FAILED not in NOT_RETRYABLE


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (UnsupportedWeightsError, ValueError),
        (MissingWeightsError, FileNotFoundError),
        (UnknownBackendError, ValueError),
        (RefusedConfigError, ValueError),
    ],
)
def test_each_type_is_still_the_builtin_callers_catch(cls: type, builtin: type) -> None:
    assert issubclass(cls, NotRetryableError) and issubclass(cls, builtin)
    assert str(cls("the reason")) == "the reason"


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (ValueError("two\nlines\n  and  spaces "), "ValueError: two lines and spaces"),
        (RefusedConfigError("x"), "RefusedConfigError: x"),
        (RuntimeError(), "RuntimeError"),
    ],
)
def test_one_line(exc: Exception, line: str) -> None:
    assert one_line(exc) == line


def test_a_checkpoint_tensor_the_wire_cannot_carry_is_refused_at_load(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    save_file({"b.counts": torch.zeros(3, dtype=torch.uint16)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(UnsupportedWeightsError) as caught:
        load_safetensors(SafetensorsWeights(path=str(tmp_path)))
    message = str(caught.value)
    assert "b.safetensors: tensor 'b.counts' has dtype uint16" in message
    assert "bfloat16" in message  # the supported dtypes are listed


def test_a_missing_checkpoint_is_not_retryable(tmp_path: Path) -> None:
    with pytest.raises(MissingWeightsError, match="does not exist"):
        load_safetensors(SafetensorsWeights(path=str(tmp_path / "absent")))
    with pytest.raises(MissingWeightsError, match=r"no \*\.safetensors files"):
        load_safetensors(SafetensorsWeights(path=str(tmp_path)))


def test_one_preemption_exception_from_the_store_to_the_session(tmp_path: Path) -> None:
    """The store's barrier wait raises the very class users catch from the session."""
    assert session.Preempted is rendezvous.Preempted
    store = FileStore(tmp_path, Layout(1, 1, 1))
    me = Member("policy", 0, 0, "uid-0")
    store.publish_metadata(me, "{}")
    notice = make_preempt_notice(0, "job-rollout-0", "uid-1", "eviction")
    store.post_preemption(notice)
    with pytest.raises(session.Preempted, match="job preempted in epoch 0: eviction") as caught:
        store.wait_barrier(me, timeout=5)
    assert caught.value.notice == notice and not caught.value.weights_partial
