"""Names in a worker pod's environment that tools without pydantic read, and the
preemption settings a user's own training loop reads from it.

``WorkerConfig`` (:mod:`.config`) is the whole environment of a RefitJob pod; two of its
variables also matter to code that does not load it: ``refit-signal`` (a preStop hook,
standard library only) and a user's own training loop, which wants the signal(s) to listen
for and the pid directory to register in, and nothing else.  A third, optional one is set
by users, not the operator: the port of a rank's metrics endpoint.  :meth:`Preemption.from_env`
reads those two with the same parser :mod:`.config` uses.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from refit_worker.contract.signals import parse_signal_list

#: Every worker config variable starts with this; a RefitJob may not set such names itself.
ENV_PREFIX = "REFIT_"
#: The preemption signal(s) the worker listens for: comma-separated names.
PREEMPTION_SIGNAL_ENV = "REFIT_PREEMPTION_SIGNAL"
#: The directory (a shared emptyDir in a pod) where every process that entered
#: ``DistributedSignalHandler`` registers its pid, for the preStop delivery command.
SIGNAL_PID_DIR_ENV = "REFIT_SIGNAL_PID_DIR"

#: Optional: the port where ``refit-worker`` serves its rank's refit figures for
#: Prometheus (``/metrics``); the operator sets it from the RefitJob's ``metrics.port``.
METRICS_PORT_ENV = "REFIT_METRICS_PORT"

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM,)


def metrics_port_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """``REFIT_METRICS_PORT`` as a port number; None when unset or empty.

    ``ValueError`` names the variable when it is not a port (1-65535)."""
    environ = os.environ if environ is None else environ
    text = environ.get(METRICS_PORT_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{METRICS_PORT_ENV}={text!r}: not a port number (1-65535)")
    return int(text)


@dataclass(frozen=True, slots=True)
class Preemption:
    """What a training loop needs to hear a preemption: signals, and where to register."""

    #: The signals to listen for (``DistributedSignalHandler(signals)``).
    signals: tuple[signal.Signals, ...] = DEFAULT_SIGNALS
    #: The pid directory (``DistributedSignalHandler(..., pid_dir=...)``); "" for none.
    pid_dir: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Preemption:
        """Read ``REFIT_PREEMPTION_SIGNAL`` (default SIGTERM) and ``REFIT_SIGNAL_PID_DIR``.

        ``ValueError`` names the variable when its signal list is invalid.
        """
        environ = os.environ if environ is None else environ
        text = environ.get(PREEMPTION_SIGNAL_ENV, "")
        try:
            signals = parse_signal_list(text) if text.strip() else DEFAULT_SIGNALS
        except ValueError as exc:
            raise ValueError(f"{PREEMPTION_SIGNAL_ENV}: {exc}") from None
        return cls(signals, environ.get(SIGNAL_PID_DIR_ENV, ""))
