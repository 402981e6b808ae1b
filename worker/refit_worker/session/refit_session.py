""":class:`RefitSession`: what a policy-side and a rollout-side session have in common.

A session is one role's: :class:`~refit_worker.policy.policy_session.PolicySession` sends refits,
:class:`~refit_worker.rollout.rollout_session.RolloutSession` receives them.  Both are built on one
:class:`~refit_worker.session.connection.Connection` (the engine, the store, the peers, the
reports) and keep their role's state to themselves.  ``RefitSession(config)`` and
:meth:`RefitSession.from_env` return the session of the rank's role, so code that serves
both roles needs one entry point; ``PolicySession(config)`` (or ``.from_env()``) says
which role the caller expects and refuses the other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar, Self

from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.failures import RefusedConfigError
from refit_worker.contract.roles import Role
from refit_worker.engine import TargetWeightLayout
from refit_worker.rendezvous import Member, RendezvousStore
from refit_worker.session.connection import Connection
from refit_worker.session.following import PeerSet
from refit_worker.session.reporting import ProgressReporter

log = logging.getLogger(__name__)

_BY_ROLE: dict[str, type[RefitSession]] = {}


class RefitSession:
    """One rank's side of a RefitJob: connect once, then send (policy) or receive
    (rollout) refits; see :mod:`refit_worker`."""

    #: The role this class serves (None: pick by the config's role).
    role: ClassVar[Role | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.role is not None and cls.role not in _BY_ROLE:
            _BY_ROLE[cls.role] = cls  # the first class of a role is the one dispatched to

    def __new__(cls, config: WorkerConfig, **kwargs: Any) -> Self:
        if cls.role is None:
            chosen = _BY_ROLE.get(config.role)
            if chosen is None:
                raise RefusedConfigError(f"no session for role {config.role!r}")
            return object.__new__(chosen)  # type: ignore[return-value]
        if config.role != cls.role:
            raise RefusedConfigError(
                f"{cls.__name__} is for {cls.role} ranks; this is {config.role} rank "
                f"{config.rank} (use RefitSession.from_env() to get the role's session)"
            )
        return object.__new__(cls)

    def __init__(
        self,
        config: WorkerConfig,
        *,
        store: RendezvousStore | None = None,
        stop_requested: Callable[[], bool] | None = None,
        target_layout: TargetWeightLayout | None = None,
    ) -> None:
        stop = stop_requested if stop_requested is not None else (lambda: False)
        self.connection = Connection(
            config, store=store, stop_requested=stop, target_layout=target_layout
        )
        self._init_role()

    def _init_role(self) -> None:
        """The role's own state, set once the connection exists (none by default)."""

    @classmethod
    def from_env(cls, **kwargs: Any) -> Self:
        """The session for the rank described by this process's ``REFIT_*`` environment."""
        return cls(WorkerConfig.from_env(), **kwargs)

    # -- what both roles expose ------------------------------------------------------

    @property
    def config(self) -> WorkerConfig:
        return self.connection.config

    @property
    def member(self) -> Member:
        return self.connection.member

    @property
    def store(self) -> RendezvousStore:
        return self.connection.store

    @property
    def reporter(self) -> ProgressReporter:
        """This rank's progress reports: every refit sent or committed is published."""
        return self.connection.reporter

    @property
    def pending_refits(self) -> range:
        """The refit ids this rank still has to move: from the last one it sent or
        committed + 1 (at the start, ``first_refit``: where a recreated gang or a
        replacement resumes) to the job's ``refits``.  Evaluated anew on each access: a
        rollout rank that joined late skips the refits it missed, so loop with
        ``while session.pending_refits: await session.receive()``; a policy rank may
        ``for refit in session.pending_refits``."""
        return self.connection.pending_refits

    def preemption_pending(self) -> bool:
        """Whether this process got the signal or the job posted a preemption notice
        that stops this rank's role (a notice for the policy gang alone leaves rollout
        ranks serving: they join the next epoch)."""
        return self.connection.preemption_pending()

    # -- set-up and teardown ---------------------------------------------------------

    def connect(self) -> None:
        """Publish metadata, wait for the barrier of this epoch, connect to the peers.

        A gang recreated after the last refit was committed (a drain that met the final
        commit) has nothing to move: it connects to no one, so no rank reaches for a peer
        that already finished and left; ``reporter.finish()`` then reports it done."""
        cfg = self.config
        if not self.pending_refits:
            log.info(
                "%s rank %d (epoch %d): all %d refits were committed in earlier epochs;"
                " nothing to connect for",
                cfg.role,
                cfg.rank,
                cfg.epoch,
                cfg.transfer.refits,
            )
            return
        self._before_connect()
        self.connection.open(self._join)

    def _before_connect(self) -> None:
        """The role's own set-up before anything is published (the policy gang's group)."""

    def _join(self, peers: PeerSet) -> None:
        """Take this rank's place in the membership and connect the engine to its peers."""
        raise NotImplementedError

    def close(self) -> None:
        """Disconnect and free the engine's buffers, and close the store; idempotent."""
        self.connection.close()

    def __enter__(self) -> Self:
        self.connect()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        # Say how this rank stopped before it goes, so the job's status can tell.
        self.connection.report_end(exc_type, exc)
        self.close()
