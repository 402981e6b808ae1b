"""``refit-worker`` / ``python -m refit_worker``: the program a RefitJob pod runs.

Reads its :class:`~refit_worker.contract.config.WorkerConfig` from the ``REFIT_*`` environment,
joins its role's torch.distributed group (gloo on CPU, nccl on CUDA) through the role's
rank-0 address, and then, under :class:`DistributedSignalHandler` with the configured
signal:

- a **policy** rank loads its weights, and for each refit changes them (a stand-in for a
  training step) and streams them to the rollout members of the moment; after the last
  refit it lingers, sending it again to members that joined late, until every rollout
  rank is done (or nothing changed for ``timeout_seconds``);
- a **rollout** rank receives each refit into a staging area, verifies it (manifest
  completeness always; for synthetic weights also every tensor bit for bit against the
  weights regenerated for the refit id that arrived: a late joiner skips refits) and
  commits it.  Rollout ranks join no torch.distributed group: each is a failure domain of
  its own, replaced alone, and it follows a policy restart without one of its own.

Each rank reports progress under its own rendezvous key.  On a signal or a preemption
notice for its role a rank stops at its next bucket or refit boundary, reports
``preempted`` and exits with :data:`EXIT_PREEMPTED`.  Exit 0 means every refit done, or
(a rollout rank) ``left``: removed by a scale-down.  A stale rollout pod (another pod holds
its rank) exits :data:`EXIT_PREEMPTED` and reports nothing.
A failure, at start-up too, is stated in one line in the termination message; the exit
code says whether a restart could cure it (:mod:`refit_worker.contract.failures`):
:data:`EXIT_NOT_RETRYABLE` if not, else :data:`EXIT_FAILED`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from typing import NoReturn

import torch
import torch.distributed as dist

from refit_worker import (
    PolicySession,
    Preempted,
    RefitSession,
    RefitStats,
    RolloutSession,
    StateDict,
    Verifier,
)
from refit_worker.contract.config import ConfigError, SyntheticWeights, WorkerConfig
from refit_worker.contract.entries import Verification
from refit_worker.contract.env import metrics_port_from_env
from refit_worker.contract.exits import (
    EXIT_BAD_CONFIG,
    EXIT_FAILED,
    EXIT_NOT_RETRYABLE,
    EXIT_PREEMPTED,
)
from refit_worker.contract.failures import exit_code_for, is_retryable, one_line
from refit_worker.contract.progress import ProgressLog
from refit_worker.contract.waits import Backoff, WaitTimeout, poll_until
from refit_worker.pod.metrics import RankLabels, RankMetrics, serve
from refit_worker.pod.termination import write_termination_message
from refit_worker.pod.weights import advance, load_weights
from refit_worker.policy.gang_plan import join_policy_group
from refit_worker.session.refits import HandedOver, Removed, Superseded
from refit_worker.signals.handler import DistributedSignalHandler

log = logging.getLogger("refit_worker")

#: After an error, how long to wait for a preemption notice that would explain it.
NOTICE_WAIT_S = 10.0
#: Longest the torch.distributed group's teardown may take: with a peer gone mid-collective
#: it can wait for that collective's timeout, past the pod's grace period.
TEARDOWN_S = 5.0
_NOTICE_POLL = Backoff(first=0.1, cap=0.1)


class VerificationError(RuntimeError):
    """A received refit differs from what the policy sent."""


def _parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="refit-worker",
        description=(
            "Run one policy or rollout rank of a RefitJob. All settings come from REFIT_* "
            "environment variables, which the operator (or `refit run`) renders from the "
            "RefitJob; see refit_worker.contract.config.WorkerConfig."
        ),
        epilog=f"Exit codes: 0 done, {EXIT_FAILED} failed (a restart may cure it), "
        f"{EXIT_BAD_CONFIG} bad environment, {EXIT_PREEMPTED} preempted (the operator "
        f"restarts the gang), {EXIT_NOT_RETRYABLE} failed in a way no restart can cure "
        "(an unsupported dtype or missing file in the checkpoint, an unknown NIXL backend, a "
        "setting this worker refuses): the job fails at once. The reason is written to the "
        "termination message in one line.",
    )


def main(argv: list[str] | None = None) -> int:
    _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        config = WorkerConfig.from_env()
        metrics_port = metrics_port_from_env()
    except (ConfigError, ValueError) as exc:
        print(f"refit-worker: {exc}", file=sys.stderr)
        write_termination_message(f"refit-worker: {' '.join(str(exc).split())}")
        return EXIT_BAD_CONFIG
    code = run(config, metrics_port)
    # This rank has stopped; a preemption signal arriving during interpreter teardown
    # (NIXL/UCX and gloo threads take a moment) has nothing left to stop and must not turn
    # a clean exit into a signal death.
    for sig in config.preemption_signal:
        signal.signal(sig, signal.SIG_IGN)
    log.info("exiting with code %d", code)
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """Exit with ``code`` without the interpreter's own teardown.

    The rank has stopped, freed its engine and reported; what the interpreter would still
    do is run NIXL/UCX and torch destructors, measured at 0.6-4 s after a NIXL agent on a
    loaded 2-core machine (and without a bound after a group teardown left stuck).  A
    drained pod once logged its exit code and was then SIGKILLed at its grace period's end
    (137 for 83), so the code the pod reports would be the kubelet's, not the rank's."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def destroy_group(seconds: float = TEARDOWN_S) -> bool:
    """Destroy the default process group in a daemon thread, waiting at most ``seconds``;
    False (logged) when it did not finish in time: the process then exits without it
    (:func:`exit_now`)."""
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as exc:  # the group is going either way
            log.warning("process group teardown failed: %s", one_line(exc))
        finally:
            done.set()

    threading.Thread(target=destroy, daemon=True, name="process-group-teardown").start()
    if done.wait(seconds):
        return True
    log.warning(
        "the process group's teardown did not finish in %gs (a peer left mid-collective); "
        "exiting without it",
        seconds,
    )
    return False


def _serve_metrics(
    progress: ProgressLog, labels: RankLabels, port: int | None, who: str
) -> RankMetrics | None:
    """The rank's figures on ``port``; a port already taken (several ranks on one machine,
    as in ``refit run``) costs the metrics, never the refits."""
    if port is None:
        return None
    try:
        return serve(progress, labels, port)
    except OSError as exc:
        log.warning("%s: cannot serve metrics on port %d (%s); going on without", who, port, exc)
        return None


def run(config: WorkerConfig, metrics_port: int | None = None) -> int:
    """Run this rank to completion; returns the process exit code.  With ``metrics_port``
    its refit figures are served there for Prometheus while it runs.

    Every failure, at start-up too (joining the group, entering the handler, building the
    session), ends in the termination message and an exit code: :data:`EXIT_NOT_RETRYABLE`
    when a restart would meet it again, else :data:`EXIT_FAILED`.
    """
    who = f"{config.role} rank {config.rank} (epoch {config.epoch})"
    try:
        if config.role == "policy":
            join_policy_group(config)
        # Everything, clean-up included, stays inside the handler: a preemption signal that
        # arrives while this rank is already stopping must not kill it half-way.
        with DistributedSignalHandler(
            config.preemption_signal, pid_dir=config.signal_pid_dir
        ) as handler:
            try:
                return _serve(config, handler, metrics_port, who)
            finally:
                if dist.is_initialized():
                    destroy_group()
    except Exception as exc:
        return _failed(config, who, exc)


def _serve(
    config: WorkerConfig,
    handler: DistributedSignalHandler,
    metrics_port: int | None,
    who: str,
) -> int:
    """Build the session, run the refits, and close it whatever happened."""
    session = RefitSession(config, stop_requested=lambda: handler.received)
    labels = RankLabels(config.job, config.role, config.rank, config.epoch)
    # The rank's own figures, from the same log its progress reports come from.
    exporter = _serve_metrics(session.reporter.log, labels, metrics_port, who)
    try:
        return _refit_all(config, session, handler, who)
    finally:
        session.close()
        if exporter is not None:
            exporter.close()


def _refit_all(
    config: WorkerConfig, session: RefitSession, handler: DistributedSignalHandler, who: str
) -> int:
    """Connect and move every pending refit; a stop or failure is reported, then returned."""
    try:
        # Loaded before connecting: a checkpoint no refit could carry fails before any
        # peer connects to this rank.
        state = _initial_state(config)
        log.info("%s: connecting", who)
        session.connect()
        asyncio.run(_refits(config, session, handler, state))
        session.reporter.finish()
        log.info("%s: all %d refits done", who, config.transfer.refits)
        return 0
    except Removed as exc:
        log.info("%s: leaving: %s", who, exc)
        session.reporter.publish("left", str(exc))
        return 0
    except Superseded as exc:
        # Not a word under the rank's progress key: it is the replacement's now.
        if isinstance(exc, HandedOver):
            log.warning("%s: preempted: %s", who, exc)
        else:
            log.warning("%s: stale pod, exiting: %s", who, exc)
        return EXIT_PREEMPTED
    except Preempted as exc:
        log.warning("%s: preempted: %s", who, exc)
        session.reporter.publish("preempted", str(exc))
        return EXIT_PREEMPTED
    except Exception as exc:
        # A peer that stopped for a preemption breaks our transfer or collective first;
        # the notice (or our own signal) follows within moments.  No notice explains a
        # failure no restart can cure, so that one is not kept waiting.
        if is_retryable(exc) and _preemption_follows(session, NOTICE_WAIT_S):
            log.warning("%s: preempted (after %s)", who, one_line(exc))
            session.reporter.publish("preempted", f"after {one_line(exc)}")
            return EXIT_PREEMPTED
        session.reporter.publish("failed", one_line(exc))
        return _failed(config, who, exc)


def _failed(config: WorkerConfig, who: str, exc: Exception) -> int:
    """Log ``exc`` with its traceback, state it in one line in the termination message, and
    return its exit code."""
    code = exit_code_for(exc)
    cure = "no restart can cure it" if code == EXIT_NOT_RETRYABLE else "a restart may cure it"
    log.error("%s: failed (%s; exit %d)", who, cure, code, exc_info=exc)
    write_termination_message(one_line(exc), config.termination_message_path)
    return code


def _preemption_follows(session: RefitSession, seconds: float) -> bool:
    """Whether a preemption is under way now or is announced within ``seconds``."""
    try:
        return poll_until(
            session.preemption_pending,
            timeout=seconds,
            what="a preemption notice that explains the error",
            backoff=_NOTICE_POLL,
        )
    except WaitTimeout:
        return False  # nothing announced in time: a failure of its own
    except Exception:  # the store is unreachable: it cannot tell us
        return False


def _initial_state(config: WorkerConfig) -> StateDict:
    """The weights as they were after the refits earlier epochs already moved."""
    state = load_weights(config.weights)
    for step in range(1, config.first_refit + 1):
        advance(state, step, _changes(config))
    return state


def _changes(config: WorkerConfig) -> float | None:
    """The synthetic model's share of elements a step changes (None: all, or real weights)."""
    return config.weights.changes if isinstance(config.weights, SyntheticWeights) else None


async def _refits(
    config: WorkerConfig,
    session: RefitSession,
    handler: DistributedSignalHandler,
    state: StateDict,
) -> None:
    """The demo's refits; the session publishes each one's figures as it commits it."""
    if isinstance(session, PolicySession):
        for refit in session.pending_refits:
            _stop_at_boundary(config, session, handler)
            # Refit k carries the weights after training step k + 1.
            await _train_step(config, session)
            advance(state, refit + 1, _changes(config))
            _log_refit(config, await session.send(state.items(), refit_id=refit))
        # Late joiners (a replacement, a scale-up) still get the last refit.
        await session.linger(state.items())
        return
    assert isinstance(session, RolloutSession)  # the session is of the config's role
    verify = _verifier(config, state)
    # Bit-exact against regenerated weights for a synthetic model; else what the engine
    # itself checks (integrity hashes, the manifest): the status claims no more.
    verified_as: Verification | None = "bit-exact" if verify is not None else None
    # Not a fixed range: a rank that joined late takes the next refit sent, skipping
    # those it missed, so the count of refits left shrinks by more than one.
    try:
        while session.pending_refits:
            _stop_at_boundary(config, session, handler)
            _log_refit(config, await session.receive(verify=verify, verified_as=verified_as))
    except Preempted as exc:
        # This pod's own stop signal (a drain, an eviction): its replacement is on its way
        # and may be seeded from here, so the replica is not gone for longer than that.
        if handler.received:
            replacement = await session.hand_over(config.hand_over_seconds)
            if replacement is not None:
                raise HandedOver(f"{exc}; handed over to pod {replacement}") from exc
        raise
    # Late peers (a replacement, a scale-up) are seeded from here, so the policy can go.
    await session.linger()


async def _train_step(config: WorkerConfig, session: PolicySession) -> None:
    """The demo's stand-in for a training step: ``weights.synthetic.pace`` seconds, cut
    short by a stop request (the boundary check that follows acts on it).  With
    ``weights.synthetic.lockstep`` it first waits for every rollout slot to serve the last
    refit sent, as a synchronous on-policy trainer waits for rollouts of those weights."""
    synthetic = config.weights if isinstance(config.weights, SyntheticWeights) else None
    last = session.last_sent
    if synthetic is not None and synthetic.lockstep and last is not None:
        await session.await_rollouts(last)
    pace = synthetic.pace if synthetic is not None else None
    deadline = time.monotonic() + (pace or 0.0)
    while (left := deadline - time.monotonic()) > 0 and not session.preemption_pending():
        await asyncio.sleep(min(left, 0.2))


def _stop_at_boundary(
    config: WorkerConfig, session: RefitSession, handler: DistributedSignalHandler
) -> None:
    """A refit boundary: stop if any rank of the role got the signal, or the job is preempted.

    ``signals_received`` is a collective: if a peer already left, it raises, and
    :func:`run` tells a preemption from a failure.
    """
    flags = handler.signals_received()
    if any(flags):
        ranks = [r for r, flag in enumerate(flags) if flag]
        raise Preempted(f"signal received by {config.role} rank(s) {ranks}")
    if session.preemption_pending():
        raise Preempted("the job posted a preemption notice")


def _verifier(config: WorkerConfig, expected: StateDict) -> Verifier | None:
    """For synthetic weights, a bit-for-bit check against the expected state, regenerated
    for the refit id that arrived (``expected`` starts as the state after
    ``first_refit`` steps and only moves forward: refit ids arrive in increasing order)."""
    if not isinstance(config.weights, SyntheticWeights):
        return None  # the engine's manifest (and checksums) are all there is to check
    steps = {"done": config.first_refit}

    def verify(refit_id: int, staged: StateDict) -> None:
        # Refit k carries the weights after training step k + 1.
        for step in range(steps["done"] + 1, refit_id + 2):
            advance(expected, step, _changes(config))
        steps["done"] = max(steps["done"], refit_id + 1)
        if staged.keys() != expected.keys():
            missing = sorted(expected.keys() - staged.keys())[:3]
            extra = sorted(staged.keys() - expected.keys())[:3]
            raise VerificationError(
                f"refit {refit_id}: names differ (missing {missing}, unexpected {extra})"
            )
        for name, tensor in staged.items():
            want = expected[name]
            if (
                tensor.dtype != want.dtype
                or tensor.shape != want.shape
                or not torch.equal(tensor.view(torch.uint8), want.view(torch.uint8))
            ):
                raise VerificationError(f"refit {refit_id}: tensor {name!r} is not bit-exact")

    return verify


def _log_refit(config: WorkerConfig, stats: RefitStats) -> None:
    verb = "sent" if config.role == "policy" else "committed"
    # RefitStats.seconds: the transfer and the commit only (not generation or verification).
    log.info(
        "%s rank %d: refit %d %s: %d bytes in %.3fs of transfer and commit (%.2f GB/s)",
        config.role,
        config.rank,
        stats.refit_id,
        verb,
        stats.bytes,
        stats.seconds,
        stats.gbps,
    )


__all__ = ["main", "run"]

if __name__ == "__main__":
    sys.exit(main())
