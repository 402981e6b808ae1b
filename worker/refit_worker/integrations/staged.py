"""Receive refits beside a serving engine, hand each one over only once it is whole.

An inference engine must keep generating while a refit streams in, and must never see a
partial one.  :class:`StagedReceiver` runs a :class:`~refit_worker.RolloutSession` on
a background thread with its own event loop: :meth:`~StagedReceiver.begin` starts
receiving refit ``k`` into the session's own double-buffered, NIXL-registered staging
memory (the trainer's names, dtypes and shapes) while the engine's thread goes on serving;
once every byte arrived and passed the session's integrity check (manifest completeness,
and the per-tensor hashes when the job carries them), :meth:`~StagedReceiver.staged` hands
the staged tensors to the engine's thread, which lands them in the live engine (its own
loader) between two generation steps, optionally checks the result, and then
:meth:`~StagedReceiver.commit`-s (the session commits and reports progress) or
:meth:`~StagedReceiver.reject`-s it.  A refit that fails or is preempted before it was
staged never reached the engine, so the served weights stay whole.

Tensors whose name starts with :data:`EXTRA_PREFIX` travel with a refit but are no weights
(for example the trainer's expected greedy tokens for fixed prompts): :func:`split_extras`
keeps them out of the landing.

The per-refit figures are published through the session's progress reporter: the
session's own report (bytes, transfer seconds, ``verified_as``), then the same report's
message naming the split into transfer, landing and verification seconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.entries import ServedVersion, Verification
from refit_worker.contract.waits import WaitTimeout
from refit_worker.rendezvous import Preempted
from refit_worker.rollout.rollout_session import RolloutSession
from refit_worker.session.refits import DeltaChanges, RefitStats

#: Names under this prefix ride along with a refit but are not weights to land.
EXTRA_PREFIX = "refit.extra."


class RefitRejected(RuntimeError):
    """The engine refused a staged refit (its layout, landing or check failed)."""


@dataclass(frozen=True)
class StagedRefit:
    """A refit received whole and integrity-checked, not yet committed.

    ``weights`` and ``extras`` are views of the session's staging memory: valid until the
    refit after the next one starts (land or copy them before that)."""

    refit_id: int
    weights: dict[str, torch.Tensor]
    extras: dict[str, torch.Tensor]
    #: Seconds from calling :meth:`StagedReceiver.begin` until the refit was staged: the
    #: wait for the trainer plus the transfer (the engine's own figure is in the commit).
    staged_after_s: float
    #: It came as a delta: onto which refit, and the tensors it changed (None: whole).
    delta: DeltaChanges | None = None


@dataclass(frozen=True)
class CommittedFigures:
    """One committed refit, split into its phases (seconds)."""

    stats: RefitStats
    landing_s: float
    verify_s: float
    #: The version now served: this refit and the digest of its bytes (see
    #: :attr:`RolloutSession.served_version`).
    version: ServedVersion | None = None
    #: The tensors the landing reloaded, of the refit's (None: not counted).
    reloaded: tuple[int, int] | None = None

    @property
    def message(self) -> str:
        part = ""
        if self.reloaded is not None and self.reloaded[0] != self.reloaded[1]:
            part = f" ({self.reloaded[0]} of {self.reloaded[1]} tensors: a delta's modules)"
        return (
            f"refit {self.stats.refit_id} committed: transfer {self.stats.seconds:.4f} s, "
            f"landing {self.landing_s:.4f} s{part}, verification {self.verify_s:.4f} s"
        )


def split_extras(
    state: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(weights, extras)``: the tensors to land, and those under :data:`EXTRA_PREFIX`
    (keyed without the prefix)."""
    weights = {n: t for n, t in state.items() if not n.startswith(EXTRA_PREFIX)}
    extras = {
        n.removeprefix(EXTRA_PREFIX): t for n, t in state.items() if n.startswith(EXTRA_PREFIX)
    }
    return weights, extras


class _Decision:
    """The engine thread's verdict on a staged refit, awaited by the receiving thread."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.rejected: str | None = None
        #: The level this refit reached, where it is not the one given at ``begin``.
        self.claim: Verification | None = None


class StagedReceiver:
    """A rollout rank's session, receiving in the background; one refit in flight at once.

    Order of calls (from the engine's thread): ``begin(k)``, then ``staged()`` (blocks
    until refit ``k`` is whole, or raises what stopped it: ``Preempted``, a timeout...),
    land it, then ``commit(...)`` or ``reject(reason)``.  :meth:`close` ends the session.
    The session connects (publishes its metadata, waits for the barrier) on the
    background thread at the first ``begin``, so that wait does not stop generation either.
    """

    def __init__(self, session: RolloutSession) -> None:
        self.session = session
        self._timeout_s = session.config.transfer.timeout_seconds
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="refit-receiver", daemon=True
        )
        self._thread.start()
        self._connected = False
        self._future: concurrent.futures.Future[RefitStats] | None = None
        self._refit_id: int | None = None
        self._staged: StagedRefit | None = None
        self._staged_event = threading.Event()
        self._decision = _Decision()
        self._begun_at = 0.0

    # -- the engine thread's calls ----------------------------------------------------

    def begin(self, refit_id: int, *, verified_as: Verification | None = None) -> None:
        """Start receiving refit ``refit_id`` in the background; returns at once.

        ``verified_as`` names the check the caller makes between landing and commit (for
        the job's status); None: only the session's own (integrity) check is claimed."""
        if self._future is not None:
            raise RuntimeError(
                f"refit {self._refit_id} is still in flight: commit or reject it before "
                f"beginning refit {refit_id}"
            )
        self._refit_id, self._staged = refit_id, None
        self._staged_event.clear()
        self._decision = _Decision()
        self._begun_at = time.perf_counter()
        self._future = asyncio.run_coroutine_threadsafe(
            self._receive(refit_id, verified_as, self._decision), self._loop
        )

    @property
    def in_flight(self) -> int | None:
        """The refit begun and not yet committed or rejected, if any."""
        return self._refit_id if self._future is not None else None

    def ready(self) -> bool:
        """Whether :meth:`staged` would return (or raise) without waiting."""
        return self._staged_event.is_set() or (self._future is not None and self._future.done())

    def staged(self, timeout_s: float | None = None) -> StagedRefit:
        """The begun refit once it is whole and verified; raises what stopped it instead
        (the session's ``Preempted``, a transfer error), after which nothing is in flight."""
        future = self._require_future()
        limit = self._timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while not self._staged_event.wait(0.05):
            if future.done():
                self._finish_failed(future)
            if time.monotonic() > deadline:
                self.reject(f"not staged within {limit:g} s")
                raise WaitTimeout(
                    f"timed out after {limit:g}s waiting for refit {self._refit_id} to be "
                    "received whole"
                )
        staged = self._staged
        if staged is None:  # the event is also set when the receive failed
            self._finish_failed(future)
            raise RuntimeError("unreachable: _finish_failed raises")
        return staged

    def commit(
        self,
        *,
        landing_s: float,
        verify_s: float = 0.0,
        reloaded: tuple[int, int] | None = None,
        claim: Verification | None = None,
    ) -> CommittedFigures:
        """The staged refit is live in the engine (and passed the caller's check): let the
        session commit it and report it, with the split into phases (``reloaded``: the
        tensors the landing reloaded, of the refit's).  ``claim``: the level this refit
        reached, where less was checked than ``begin`` named (None: as begun)."""
        future = self._require_future()
        if self._staged is None:
            raise RuntimeError(f"refit {self._refit_id} is not staged yet: call staged() first")
        self._decision.claim = claim
        self._decision.event.set()
        try:
            stats = future.result(timeout=self._timeout_s)
        finally:
            self._future = None
        figures = CommittedFigures(
            stats, landing_s, verify_s, self.session.served_version, reloaded
        )
        reporter = self.session.reporter
        done = reporter.log.refits_completed >= self.session.config.transfer.refits
        reporter.publish("done" if done else "running", figures.message)
        return figures

    def reject(self, reason: str) -> None:
        """Refuse the begun refit: the session does not commit it; nothing stays in flight."""
        future = self._future
        if future is None:
            return
        self._decision.rejected = reason
        self._decision.event.set()
        try:
            future.result(timeout=self._timeout_s)
        except Exception:  # the rejection itself, or what stopped the receive
            pass
        finally:
            self._future = None

    def close(self) -> None:
        """Reject what is in flight, close the session, stop the thread; idempotent."""
        if not self._thread.is_alive():
            return
        if self._future is not None:
            self.reject("the receiver is closing")
        done = asyncio.run_coroutine_threadsafe(asyncio.to_thread(self.session.close), self._loop)
        try:
            done.result(timeout=self._timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=self._timeout_s)

    # -- the background thread ---------------------------------------------------------

    async def _receive(
        self, refit_id: int, verified_as: Verification | None, decision: _Decision
    ) -> RefitStats:
        try:
            if not self._connected:
                await asyncio.to_thread(self.session.connect)
                self._connected = True

            def hold(_: int, state: dict[str, torch.Tensor]) -> Verification | None:
                weights, extras = split_extras(state)
                self._staged = StagedRefit(
                    refit_id,
                    weights,
                    extras,
                    time.perf_counter() - self._begun_at,
                    self.session.arrived_changes,
                )
                self._staged_event.set()
                # Blocks this loop only: the transfer is over and the senders confirmed.
                if not decision.event.wait(self._timeout_s):
                    raise RefitRejected(
                        f"refit {refit_id}: the engine neither committed nor rejected it "
                        f"within {self._timeout_s:g} s"
                    )
                if decision.rejected is not None:
                    raise RefitRejected(f"refit {refit_id} rejected: {decision.rejected}")
                return decision.claim

            return await self.session.receive(
                refit_id=refit_id, verify=hold, verified_as=verified_as
            )
        except Preempted as exc:
            # As the session's own `with` block reports a rank's end: for the job's status.
            self.session.reporter.publish("preempted", str(exc)[:200])
            raise
        except Exception as exc:
            self.session.reporter.publish("failed", f"{type(exc).__name__}: {exc}"[:200])
            raise
        finally:
            self._staged_event.set()  # wake staged() on failure too

    # -- helpers ---------------------------------------------------------------------

    def _require_future(self) -> concurrent.futures.Future[RefitStats]:
        if self._future is None:
            raise RuntimeError("no refit in flight: call begin(refit_id) first")
        return self._future

    def _finish_failed(self, future: concurrent.futures.Future[Any]) -> None:
        """Re-raise what ended the receive before it was staged; nothing stays in flight."""
        self._future = None
        exc = future.exception()
        if exc is None:
            raise RuntimeError(f"refit {self._refit_id} ended without being staged")
        raise exc


def stop_flag(config: WorkerConfig) -> Callable[[], bool]:
    """A flag set by the job's preemption signal(s) in this process (main thread only:
    elsewhere the session still stops on the job's preemption notice)."""
    state = {"stop": False}

    def handler(signum: int, frame: object) -> None:
        state["stop"] = True

    try:
        for sig in config.preemption_signal:
            signal.signal(sig, handler)
    except ValueError:  # not the main thread: rely on the job-wide notice
        pass
    return lambda: state["stop"]
