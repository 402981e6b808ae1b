"""The ConfigMap rendezvous store: the job's ConfigMaps through the Kubernetes API.

Shard i lives in ConfigMap :meth:`~refit_worker.contract.rendezvous.Layout.name` (base,
i) — the operator's map, then each role's — created empty by the operator before the
pods.  Every write is a JSON merge patch ``{"data": {"<own key>": "<json>"}}``
(``application/merge-patch+json``), so writers of different keys never overwrite each
other and nobody reads-modifies-writes the map; a read takes from each map only the keys
that belong there.
A wait lists each watched shard, then watches it from that resourceVersion (one thread
per shard, each watch bounded in time); after ``410 Gone`` it lists again.  The waiting
thread sleeps on a condition the watch threads notify, through
``refit_worker.contract.waits.poll_until``, so its deadline and cancel flag work as everywhere else.

The API client is built at first use — in-cluster config inside a pod, else
``KUBECONFIG`` / ``~/.kube/config`` — never at import, and ``kubernetes`` itself is
imported only then.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from refit_worker.contract.rendezvous import Layout, merge_patch
from refit_worker.contract.waits import Backoff, CancelFlag, poll_until
from refit_worker.rendezvous.store import (
    Check,
    RendezvousError,
    RendezvousStore,
    RendezvousTimeout,
    T,
)

R = TypeVar("R")

MERGE_PATCH = "application/merge-patch+json"
#: Seconds one watch request stays open before it is renewed (server-side timeout).
WATCH_SECONDS = 30
_CONNECT_SECONDS = 10.0
_REQUEST_SECONDS = 30.0
#: Attempts for a write or read that met a transient error (429, 5xx, lost connection).
_ATTEMPTS = 5
#: Between attempts of one call, and between watches of a shard after an error.
_RETRY = Backoff(first=0.1, cap=2.0)
_REWATCH = Backoff(first=0.05, cap=2.0)
_FATAL = {400, 401, 403, 404, 422}
#: A waiting thread wakes on every change; at the latest after this, to look at its
#: cancel flag (which cannot notify the condition).
_WAKE = Backoff(first=0.25, cap=0.25)
#: How long a finished wait gives its watch threads to end.  A daemon thread still inside
#: socket code when the interpreter exits is ended by ``pthread_exit`` on Python < 3.14,
#: which can abort the whole process (SIGABRT, seen once in CI); a cut stream ends its
#: thread in milliseconds, a thread still connecting within ``_CONNECT_SECONDS``.
_JOIN_SECONDS = 2.0


def load_api_client() -> Any:
    """A ``kubernetes.client.ApiClient``: in-cluster config, else the kubeconfig."""
    from kubernetes import client
    from kubernetes import config as kube_config

    loaders: Any = kube_config  # its loaders are untyped
    configuration = client.Configuration()
    try:
        loaders.load_incluster_config(client_configuration=configuration)
    except loaders.ConfigException:
        # KUBECONFIG is read now, not when kubernetes was imported, so a later change holds.
        loaders.load_kube_config(
            config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
        )
    return client.ApiClient(configuration)


class ConfigMapStore(RendezvousStore):
    """Rendezvous over ``<base>``, ``<base>-1``, ... in ``namespace``."""

    def __init__(
        self, base_name: str, namespace: str, layout: Layout, *, api_client: Any | None = None
    ) -> None:
        super().__init__(layout)
        self.namespace = namespace
        self.base_name = base_name
        self._api_client = api_client
        self._owns_client = api_client is None
        self._core: Any | None = None
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        """The ConfigMap of each shard of the layout (which :meth:`follow` may grow)."""
        return [self.layout.name(self.base_name, shard) for shard in range(self.layout.shards)]

    def _api(self) -> Any:
        with self._lock:
            if self._core is None:
                from kubernetes import client  # at first use, never at import

                if self._api_client is None:
                    self._api_client = load_api_client()
                self._core = client.CoreV1Api(self._api_client)
            return self._core

    def close(self) -> None:
        with self._lock:
            if self._owns_client and self._api_client is not None:
                self._api_client.close()
                self._api_client = None
            self._core = None

    def _put(self, shard: int, key: str, value: str) -> None:
        name = self.names[shard]
        self._retrying(
            f"set key {key!r} of ConfigMap {self.namespace}/{name}",
            lambda: (
                self._api()
                .patch_namespaced_config_map(
                    name,
                    self.namespace,
                    merge_patch(key, value),
                    _content_type=MERGE_PATCH,
                    _request_timeout=(_CONNECT_SECONDS, _REQUEST_SECONDS),
                    _preload_content=False,
                )
                .release_conn()
            ),
        )

    def _read(self, shard: int) -> dict[str, str]:
        return self._get(shard)[0]

    def _get(self, shard: int) -> tuple[dict[str, str], str]:
        """The shard's data and resourceVersion, straight from the API as JSON."""
        name = self.names[shard]
        raw = self._retrying(
            f"read ConfigMap {self.namespace}/{name}",
            lambda: (
                self._api()
                .read_namespaced_config_map(
                    name,
                    self.namespace,
                    _preload_content=False,
                    _request_timeout=(_CONNECT_SECONDS, _REQUEST_SECONDS),
                )
                .read()
            ),
        )
        obj = json.loads(raw)
        return _data_of(obj), str(obj.get("metadata", {}).get("resourceVersion", ""))

    def _retrying(self, action: str, call: Callable[[], R]) -> R:
        """``call()``, again after a transient error (429, 5xx, lost connection); every
        call here is idempotent (a read, or setting one key to one value)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        delays, attempt = _RETRY.delays(), 1
        while True:
            try:
                return call()
            except ApiException as exc:
                if exc.status in _FATAL or attempt >= _ATTEMPTS:
                    raise RendezvousError(
                        f"could not {action}: HTTP {exc.status} {exc.reason}"
                    ) from exc
            except HTTPError as exc:
                if attempt >= _ATTEMPTS:
                    raise RendezvousError(f"could not {action}: {exc}") from exc
            time.sleep(next(delays))
            attempt += 1

    def _wait(
        self,
        shards: Sequence[int],
        check: Check[T],
        timeout: float,
        what: str,
        cancel: CancelFlag | None,
    ) -> T:
        state = _WaitState()
        feeds = [
            threading.Thread(
                target=self._feed,
                args=(shard, state),
                daemon=True,
                name=f"rendezvous-watch-{self.names[shard]}",
            )
            for shard in shards
        ]
        for feed in feeds:
            feed.start()

        def ready() -> T | None:  # called with state.cond held
            if state.error is not None:
                raise state.error
            if len(state.data) < len(shards):
                return None  # a shard not listed yet
            merged: dict[str, str] = {}
            for shard in shards:
                merged.update(self._home(shard, state.data[shard]))
            return check(merged)

        def doze(seconds: float) -> None:  # releases the lock; every change wakes it early
            state.cond.wait(seconds)

        names = ", ".join(self.names[s] for s in shards)
        try:
            with state.cond:
                return poll_until(
                    ready,
                    timeout=timeout,
                    what=f"{what} in ConfigMap {self.namespace}/{names}",
                    backoff=_WAKE,
                    cancel=cancel,
                    error=RendezvousTimeout,
                    sleep=doze,
                )
        finally:
            state.stop()
            _join(feeds, _JOIN_SECONDS)

    def _feed(self, shard: int, state: _WaitState) -> None:
        """Keep ``state.data[shard]`` current: list, then watch; list again after 410."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        name = self.names[shard]
        version = ""
        delays = _REWATCH.delays()
        while not state.stopped.is_set():
            try:
                if not version:
                    data, version = self._get(shard)
                    state.update(shard, data)
                for kind, obj in self._watch(name, version, state):
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            version = ""  # history expired: list again
                            break
                        raise RendezvousError(
                            f"watch of ConfigMap {self.namespace}/{name} "
                            f"failed: {obj.get('message', obj)}"
                        )
                    version = str(obj.get("metadata", {}).get("resourceVersion", version))
                    if kind in ("ADDED", "MODIFIED", "DELETED") and _name_of(obj) == name:
                        state.update(shard, {} if kind == "DELETED" else _data_of(obj))
                delays = _REWATCH.delays()
            except ApiException as exc:
                if exc.status == 410:
                    version = ""
                    continue
                if exc.status in _FATAL:
                    state.fail(
                        RendezvousError(
                            f"could not watch ConfigMap "
                            f"{self.namespace}/{name}: HTTP {exc.status} "
                            f"{exc.reason}"
                        )
                    )
                    return
                state.stopped.wait(next(delays))
            except (HTTPError, OSError, ValueError):
                if state.stopped.is_set():
                    return  # the waiter cut our stream on purpose
                state.stopped.wait(next(delays))  # lost connection or read timeout: again
            except BaseException as exc:  # handed to the waiting thread
                state.fail(exc)
                return

    def _watch(
        self, name: str, version: str, state: _WaitState
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        response = self._api().list_namespaced_config_map(
            self.namespace,
            field_selector=f"metadata.name={name}",
            watch=True,
            resource_version=version or None,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_SECONDS,
            _preload_content=False,
            _request_timeout=(_CONNECT_SECONDS, WATCH_SECONDS + 5.0),
        )
        state.track(response)
        try:
            buffer = b""
            for chunk in response.stream(amt=None, decode_content=False):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                yield from _events(lines)
            # A server may end the stream with an event and no newline (an ERROR, say).
            yield from _events([buffer])
        finally:
            state.untrack(response)
            if state.stopped.is_set():
                response.close()  # cut short: the connection is not fit for reuse
            else:
                response.release_conn()


class _WaitState:
    """What the watch threads of one wait share with the waiting thread."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.data: dict[int, dict[str, str]] = {}
        self.error: BaseException | None = None
        self.stopped = threading.Event()
        self._open: set[Any] = set()

    def update(self, shard: int, data: dict[str, str]) -> None:
        with self.cond:
            self.data[shard] = data
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            self.error = self.error or error
            self.cond.notify_all()

    def track(self, response: Any) -> None:
        with self.cond:
            self._open.add(response)
        if self.stopped.is_set():
            _interrupt(response)

    def untrack(self, response: Any) -> None:
        with self.cond:
            self._open.discard(response)

    def stop(self) -> None:
        """Tell the watch threads to end, and cut their streams so none lingers."""
        self.stopped.set()
        with self.cond:
            responses = list(self._open)
        for response in responses:
            _interrupt(response)


def _join(threads: Sequence[threading.Thread], seconds: float) -> None:
    """Join ``threads`` within ``seconds`` in all; one that has not ended by then is left
    (it is a daemon and stops at its next look at the stop flag)."""
    deadline = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _interrupt(response: Any) -> None:
    """Unblock a thread reading ``response``.  ``close()`` from another thread would wait
    for the reader's lock; ``shutdown()`` (urllib3 >= 2.3) cuts the socket instead.  Without
    it the reader ends with its watch, at most WATCH_SECONDS later."""
    shutdown = getattr(response, "shutdown", None)
    if shutdown is not None:
        # Each of these says the stream is already closed or released: nothing to cut.
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            shutdown()


def _events(lines: list[bytes]) -> Iterator[tuple[str, dict[str, Any]]]:
    for line in lines:
        if line.strip():
            event = json.loads(line)
            yield str(event.get("type")), dict(event.get("object") or {})


def _data_of(obj: dict[str, Any]) -> dict[str, str]:
    data = obj.get("data") or {}
    return {str(k): str(v) for k, v in data.items()}


def _name_of(obj: dict[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("name", ""))
