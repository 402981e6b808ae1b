"""Failures no restart can cure, as types, and the exit code a failing worker gets.

``refit-worker`` exits :data:`~refit_worker.contract.exits.EXIT_NOT_RETRYABLE` for a
:class:`NotRetryableError` (anywhere in the ``raise ... from`` chain), so the operator fails
the job at once: a restarted pod would meet the same checkpoint, backend or setting again.
Every other error exits :data:`~refit_worker.contract.exits.EXIT_FAILED` and uses up one of
the job's restarts (a lost peer, a timeout, a full disk may not happen twice).

Each type also derives from the builtin error callers already catch (``ValueError``,
``FileNotFoundError``), so raising it changes no caller's ``except``.
"""

from __future__ import annotations

from refit_worker.contract.exits import EXIT_FAILED, EXIT_NOT_RETRYABLE


class NotRetryableError(Exception):
    """A failure that a restart would meet again: the job should fail at once."""


class UnsupportedWeightsError(NotRetryableError, ValueError):
    """The checkpoint holds something refit cannot move (a dtype the wire does not carry)."""


class MissingWeightsError(NotRetryableError, FileNotFoundError):
    """The checkpoint directory, or any ``*.safetensors`` file in it, is not there."""


class UnknownBackendError(NotRetryableError, ValueError):
    """The configured NIXL backend is not available in this NIXL build."""


class RefusedConfigError(NotRetryableError, ValueError):
    """A setting that is valid in the API but that this worker does not support."""


def is_retryable(exc: BaseException) -> bool:
    """Whether a restart could cure ``exc``: no :class:`NotRetryableError` in its causes."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, NotRetryableError):
            return False
        seen.add(id(current))
        current = current.__cause__
    return True


def exit_code_for(exc: BaseException) -> int:
    """The exit code of a worker that stops on ``exc``."""
    return EXIT_FAILED if is_retryable(exc) else EXIT_NOT_RETRYABLE


def one_line(exc: BaseException) -> str:
    """``Type: message`` with every run of whitespace (newlines too) as one space."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


__all__ = [
    "MissingWeightsError",
    "NotRetryableError",
    "RefusedConfigError",
    "UnknownBackendError",
    "UnsupportedWeightsError",
    "exit_code_for",
    "is_retryable",
    "one_line",
]
