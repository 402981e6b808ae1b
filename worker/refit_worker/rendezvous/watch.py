"""Watching for the preemption notice in the background.

:class:`PreemptionWatch` runs :meth:`RendezvousStore.wait_preemption` in a daemon thread
and calls ``on_notice`` once when a notice that stops the member appears: of its epoch,
or for a rollout member of that or a later epoch; a notice for the policy gang alone
(``PreemptNotice.role`` "policy") passes a rollout member by.  A worker
typically answers by signalling itself with its preemption signal, so that
``DistributedSignalHandler`` stops every rank at the next bucket boundary, exactly as for
a pod termination.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

from refit_worker.contract.rendezvous import PreemptNotice
from refit_worker.contract.waits import WaitCancelled
from refit_worker.rendezvous.store import Member, RendezvousStore, RendezvousTimeout

#: Seconds of one wait; the watch renews it until stopped.
WAIT_SECONDS = 60.0


class PreemptionWatch:
    """``with PreemptionWatch(store, me, on_notice): ...`` watches while the block runs."""

    def __init__(
        self, store: RendezvousStore, me: Member, on_notice: Callable[[PreemptNotice], None]
    ) -> None:
        self.store, self.me, self.on_notice = store, me, on_notice
        self.notice: PreemptNotice | None = None
        #: Why the watch ended early (a garbage notice, a lost API), else None.
        self.error: BaseException | None = None
        self._cancel = threading.Event()
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"preemption-watch-{me.role}-{me.rank}"
        )

    def start(self) -> PreemptionWatch:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching; waits up to ``timeout`` seconds for the thread to end."""
        self._cancel.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> PreemptionWatch:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._cancel.is_set():
            try:
                notice = self.store.wait_preemption(self.me, WAIT_SECONDS, cancel=self._cancel)
            except RendezvousTimeout:
                continue  # nothing yet: watch again
            except WaitCancelled:
                return
            except Exception as exc:  # kept for the worker to inspect
                self.error = exc
                return
            self.notice = notice
            self.on_notice(notice)
            return
