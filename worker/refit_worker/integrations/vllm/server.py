"""Refits into a running ``vllm serve``: its online RL endpoints, driven over HTTP.

The server runs with kube-refit's backend (``--weight-transfer-config
'{"backend": "kube-refit"}'``), the worker extension (``--worker-extension-cls``, for the
backend's state) and ``VLLM_SERVER_DEV_MODE=1`` (vLLM mounts its RL and RPC endpoints only
then).  The backend receives each refit in the background while the server answers
requests; :class:`VllmServer` waits until the refit is staged, and only then pauses:

1. ``POST /pause?mode=wait&clear_cache=true``: requests in flight finish on the old
   weights, new ones queue, and the prefix/multimodal caches are dropped;
2. ``/start_weight_update``, ``/update_weights`` (``caches_cleared``: the pause cleared
   them), ``/finish_weight_update``: lands, reads back and commits the refit;
3. ``/update_weight_version`` with the committed label (``refit-<k>@<digest>``), so every
   response from now on names the refit that produced it;
4. ``/resume``.

A request therefore waits at most the landing (plus the requests it queued behind); the
transfer itself never pauses the server.  A failed landing leaves the server paused (it
serves nothing mixed) and raises :class:`ServerRefitError` with the backend's reason and
exit code; the pod exits and is replaced or fails the job.

Plain JSON over loopback HTTP (``urllib``): nothing else is imported, no vLLM either.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from refit_worker.contract.exits import EXIT_FAILED

#: vLLM's RL endpoints exist only with this set in the server's environment.
DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
#: How often the backend's state is polled while a refit streams in.
POLL_S = 0.05


class ServerRefitError(RuntimeError):
    """The server could not take a refit; ``exit_code`` is what the pod exits with."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class BackendState:
    """The ``kube-refit`` backend's state inside the server (one worker's)."""

    pending: tuple[int, ...]
    staged: int | None
    ready: bool
    weight_version: str | None
    error: Mapping[str, Any] | None

    @classmethod
    def parse(cls, plain: Mapping[str, Any]) -> BackendState:
        return cls(
            pending=tuple(int(k) for k in plain["pending"]),
            staged=None if plain["staged"] is None else int(plain["staged"]),
            ready=bool(plain["ready"]),
            weight_version=plain.get("weight_version"),
            error=plain.get("error"),
        )


@dataclass(frozen=True)
class ServedLanding:
    """One refit landed into the server: how long requests were held, and its label."""

    refit_id: int
    weight_version: str
    #: Wall-clock bounds of the pause (seconds since the epoch): no request was
    #: scheduled between them.
    paused_at: float
    resumed_at: float
    #: The phases inside the pause: draining the requests in flight, the update calls.
    drain_s: float
    update_s: float

    @property
    def paused_s(self) -> float:
        return self.resumed_at - self.paused_at

    def plain(self) -> dict[str, Any]:
        return {**asdict(self), "paused_s": self.paused_s}


class VllmServer:
    """kube-refit's side of one ``vllm serve`` at ``base_url`` (e.g.
    ``http://127.0.0.1:8000``).  ``call_timeout_s`` bounds every HTTP call but the update,
    which is bounded by ``update_timeout_s``."""

    def __init__(
        self, base_url: str, *, call_timeout_s: float = 60.0, update_timeout_s: float = 600.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.call_timeout_s = call_timeout_s
        self.update_timeout_s = update_timeout_s

    # -- HTTP -------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        as_json: bool = True,
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )
        limit = self.call_timeout_s if timeout_s is None else timeout_s
        with urllib.request.urlopen(request, timeout=limit) as response:
            raw = response.read()
        if not as_json:
            return raw.decode(errors="replace")
        return json.loads(raw) if raw else None

    def post(self, path: str, body: Mapping[str, Any]) -> str:
        """``POST path`` with a JSON body; the answer as text (vLLM's LoRA endpoints answer
        plain text), ``HTTPError`` on a refusal."""
        text: str = self._call("POST", path, body, as_json=False)
        return text

    def _rpc(self, method: str) -> Any:
        """One worker extension method through ``/collective_rpc``: the first worker's
        result (each TP worker holds the same refit state)."""
        answer = self._call("POST", "/collective_rpc", {"method": method})
        return answer["results"][0]

    # -- readiness --------------------------------------------------------------------

    def answers(self) -> bool:
        try:
            self._call("GET", "/health", timeout_s=5)
        except (urllib.error.URLError, OSError):
            return False
        return True

    def wait_ready(self, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> float:
        """Wait until the server answers ``/health``; the seconds it took.  Raises
        :class:`ServerRefitError` when it exits first or ``timeout_s`` passes, and when
        its RL endpoints are missing (started without ``VLLM_SERVER_DEV_MODE=1``)."""
        started = time.monotonic()
        while not self.answers():
            if not alive():
                raise ServerRefitError("vllm serve exited before it answered /health")
            if time.monotonic() - started > timeout_s:
                raise ServerRefitError(
                    f"vllm serve did not answer {self.base_url}/health within {timeout_s:.0f} s"
                )
            time.sleep(0.5)
        try:
            self._call("GET", "/is_paused")
        except urllib.error.HTTPError as exc:
            raise ServerRefitError(
                f"vllm serve at {self.base_url} has no RL endpoints (GET /is_paused: "
                f"{exc.code}): start it with VLLM_SERVER_DEV_MODE=1",
                exit_code=2,
            ) from exc
        return time.monotonic() - started

    # -- the backend ------------------------------------------------------------------

    def init(self, env: Mapping[str, str] | None = None) -> None:
        """Open the backend's session (``env``: the rank's ``REFIT_*`` variables; None:
        the server's own environment, as a pod's server inherits it)."""
        info = {"env": dict(env) if env is not None else None}
        self._call("POST", "/init_weight_transfer_engine", {"init_info": info})

    def state(self) -> BackendState:
        return BackendState.parse(self._rpc("refit_backend_state"))

    def wait_staged(
        self, timeout_s: float, stop: Callable[[], bool] = lambda: False
    ) -> BackendState:
        """Wait (the server answering all along) until the next refit is staged whole,
        or the backend has nothing left to take."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()
            if state.ready or not state.pending:
                return state
            if stop():
                raise ServerRefitError("stopped while waiting for a refit to be staged")
            if time.monotonic() > deadline:
                raise ServerRefitError(
                    f"refit {state.staged} was not staged within {timeout_s:.0f} s "
                    f"(pending {list(state.pending)})"
                )
            time.sleep(POLL_S)

    def land(self, refit_id: int) -> ServedLanding:
        """Pause, land refit ``refit_id``, label it and resume (see the module's text)."""
        paused_at = time.time()
        self._call("POST", "/pause?" + urllib.parse.urlencode({"mode": "wait", "clear_cache": 1}))
        drained_at = time.time()
        try:
            self._call("POST", "/start_weight_update")
            update = {"refit_id": refit_id, "caches_cleared": True}
            self._call(
                "POST",
                "/update_weights",
                {"update_info": update},
                timeout_s=self.update_timeout_s,
            )
            self._call("POST", "/finish_weight_update", {})
        except urllib.error.HTTPError as exc:
            raise self._failed(refit_id, exc) from exc
        version = self.state().weight_version
        if version is None or not version.startswith(f"refit-{refit_id}"):
            raise ServerRefitError(
                f"refit {refit_id} finished but the backend serves {version!r}: not resuming"
            )
        self._call("POST", "/update_weight_version", {"new_version": version})
        updated_at = time.time()
        self._call("POST", "/resume")
        return ServedLanding(
            refit_id=refit_id,
            weight_version=version,
            paused_at=paused_at,
            resumed_at=time.time(),
            drain_s=drained_at - paused_at,
            update_s=updated_at - drained_at,
        )

    def _failed(self, refit_id: int, exc: urllib.error.HTTPError) -> ServerRefitError:
        """The backend's own reason for a failed update (HTTP says only 500)."""
        error = None
        with contextlib.suppress(urllib.error.URLError, OSError, KeyError):
            error = self.state().error
        if error is None:
            return ServerRefitError(f"refit {refit_id}: the server answered {exc.code}")
        return ServerRefitError(
            f"refit {refit_id}: {error['message']}", exit_code=int(error["exit_code"])
        )

    def shutdown(self) -> None:
        self._call("POST", "/shutdown_weight_transfer_engine")


def serve_refits(
    server: VllmServer,
    *,
    transfer_timeout_s: float,
    stop: Callable[[], bool] = lambda: False,
    on_landed: Callable[[ServedLanding], None] = lambda landing: None,
) -> list[ServedLanding]:
    """Take every refit the backend's session has pending, each as soon as it is staged;
    the landings in order."""
    landings: list[ServedLanding] = []
    while True:
        # A refit that failed while staging is "ready" too: its landing raises the
        # backend's reason (VllmServer._failed).
        state = server.wait_staged(transfer_timeout_s, stop)
        if state.staged is None:
            return landings
        landing = server.land(state.staged)
        landings.append(landing)
        on_landed(landing)
