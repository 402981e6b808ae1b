"""The NIXL transport boundary: :class:`NixlAgent` and backend set-up helpers.

``NixlAgent`` wraps one ``nixl_agent``: memory registration, WRITE transfers described by plain
``(addr, length, dev_id)`` tuples (or prepared descriptor lists whose transfer handles are
reposted refit after refit, see :meth:`NixlAgent.prepare_writes`), and an inbox of
notifications keyed by peer.  Every wait goes through
:func:`refit_worker.contract.waits.apoll_until` with a description of what it waits for and
raises :class:`RefitTimeoutError` naming the peer and the awaited thing.  Waits inside a refit
(:data:`REFIT_BACKOFF`) re-check for 0.1 ms, then back off from 50 µs to 1 ms with
:func:`~refit_worker.contract.waits.precise_sleep`, so a message that arrives within
microseconds is seen within microseconds, not after the 1 ms that asyncio rounds short sleeps
up to; a peer that is slow costs ~1 kHz of polling, never a hot spin.  Waits between refits
(:data:`IDLE_BACKOFF`) grow to 2 ms.  The agent runs without NIXL's progress thread by default:
on a 2-core host that thread competes with the copy itself (measured ~3x slower); progress is
made by our own polls.

nixl is imported lazily so that planning, mapping and messages work without it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from refit_worker.contract.failures import UnknownBackendError
from refit_worker.contract.waits import Backoff, apoll_until, precise_sleep

from ..messages.wire import (
    Abort,
    BucketReady,
    ControlMessage,
    Credit,
    Decline,
    Done,
    Manifest,
    NixlAgentMetadata,
    ProtocolError,
    decode,
    encode,
    is_control,
)
from .nixl_backends import NIXL_DEFAULT_BACKEND_NAME, backend_params, resolve_nixl_backend_kwargs

log = logging.getLogger(__name__)

NIXL_TRANSFER_BUFFER_COUNT = 2
#: Waits inside a refit: spin 0.1 ms, then 50 µs doubling to 1 ms (precise sleeps).
REFIT_BACKOFF = Backoff(first=50e-6, cap=1e-3, spin=1e-4)
#: Waits for a refit to begin (the peer may be training or generating): up to 2 ms.
IDLE_BACKOFF = Backoff(first=50e-6, cap=2e-3, spin=1e-4)

Region = tuple[int, int, int]  # (addr, length, dev_id)


class RefitTimeoutError(TimeoutError):
    """A wait ran past its deadline; the message names the peer and what was awaited."""


class PeerError(RuntimeError):
    """A peer failed: a transfer to it went to ERR, or it aborted the refit."""


class DeclinedError(PeerError):
    """A rollout peer declined the refit (it waits for a newer one, or its sources
    disagreed): not delivered, not a failure of this rank."""


class WholeRefitWanted(DeclinedError):
    """A rollout peer declined the delta it was offered and wants the refit whole."""


def _nixl(exc: BaseException) -> str:
    """A nixl error as one line: its type (nixl's types name the status) and text."""
    return f"{type(exc).__name__}: {exc}"


class NixlAgent:
    """One NIXL agent with a backend, registered memory and a notification inbox."""

    def __init__(
        self,
        backend_name: str = NIXL_DEFAULT_BACKEND_NAME,
        backend_init_params: dict[str, Any] | None = None,
        *,
        name: str | None = None,
        progress_thread: bool = False,
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.backend_name = backend_name
        self.backend_init_params = dict(backend_init_params or {})
        self.name = name or f"refit-{uuid.uuid4().hex[:12]}"
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
        self._agent: Any = nixl_agent(self.name, config)
        if backend_name not in self._agent.get_plugin_list():
            raise UnknownBackendError(
                f"NIXL backend {backend_name!r} is not available; "
                f"available: {sorted(self._agent.get_plugin_list())}"
            )
        self._agent.create_backend(backend_name, backend_params(backend_init_params))
        self._raw: dict[str, list[bytes]] = {}
        self._control: dict[tuple[str, str, int, int], ControlMessage] = {}

    # -- metadata and peers -------------------------------------------------------------
    def get_agent_metadata(self) -> NixlAgentMetadata:
        """This agent's metadata (no buffers; the engine adds its own)."""
        return NixlAgentMetadata(agent_name=self.name, agent_metadata=self._metadata_bytes())

    def _metadata_bytes(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_remote_agent(self, metadata: NixlAgentMetadata) -> str:
        """Load a peer's metadata so transfers and notifications to it work;
        :class:`PeerError` when its agent cannot be reached (UCX connects at once)."""
        try:
            loaded = self._agent.add_remote_agent(metadata.agent_metadata)
        except Exception as exc:
            raise PeerError(
                f"cannot load peer {metadata.agent_name!r} (its agent gone?): {_nixl(exc)}"
            ) from exc
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != metadata.agent_name:
            raise ValueError(
                f"metadata names agent {metadata.agent_name!r} but its NIXL blob is {name!r}"
            )
        return name

    def reload_remote_agent(self, metadata: NixlAgentMetadata) -> None:
        """Forget what was loaded of a peer's memory and load its agent metadata again
        (NIXL cannot drop one region of a peer); its notifications already here are kept."""
        self.poll()
        self._agent.remove_remote_agent(metadata.agent_name)
        self.add_remote_agent(metadata)

    def remove_remote_agent(self, agent_name: str) -> None:
        """Forget a peer and disconnect from it."""
        self._agent.remove_remote_agent(agent_name)
        self._raw.pop(agent_name, None)
        for key in [k for k in self._control if k[0] == agent_name]:
            del self._control[key]

    # -- memory -------------------------------------------------------------------------
    def register(self, regions: Sequence[Region], mem_type: str) -> Any:
        """Register plain regions; returns the handle for :meth:`deregister`."""
        return self._agent.register_memory([(a, n, d, "") for a, n, d in regions], mem_type)

    def deregister(self, handle: Any) -> None:
        self._agent.deregister_memory(handle)

    def memory_metadata(self, handle: Any) -> bytes:
        """NIXL's partial metadata for one registration, for peers connected before it."""
        return bytes(self._agent.get_partial_agent_metadata(handle, False, []))

    def regions_metadata(self, regions: Sequence[Region], mem_type: str) -> bytes:
        """NIXL's partial metadata for registered ``regions`` (made by several registrations)."""
        descs = self._agent.get_reg_descs([(a, n, d, "") for a, n, d in regions], mem_type)
        return bytes(self._agent.get_partial_agent_metadata(descs, False, []))

    def add_remote_memory(self, peer: str, metadata: bytes) -> None:
        """Load ``peer``'s :meth:`memory_metadata` so WRITEs into that memory work."""
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except Exception as exc:  # nixl raises its own error types per status code
            raise PeerError(f"bad memory metadata from {peer!r}: {exc}") from exc
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != peer:
            raise PeerError(f"memory metadata from {peer!r} is for agent {name!r}")

    # -- transfers ----------------------------------------------------------------------
    def transfer_state(self, handle: Any) -> str:
        return str(self._agent.check_xfer_state(handle))

    async def wait_posted(self, handle: Any, peer: str, what: str, deadline: float) -> None:
        """Wait for a posted transfer to finish (the handle stays, to be posted again)."""

        def finished() -> bool:
            try:
                state = self.transfer_state(handle)
            except Exception as exc:  # a peer that died: nixl raises instead of "ERR"
                raise PeerError(f"transfer of {what} to {peer!r} failed: {_nixl(exc)}") from exc
            if state == "ERR":
                raise PeerError(f"transfer of {what} to {peer!r} failed (peer gone?)")
            return state == "DONE"

        await apoll_until(
            finished,
            timeout=max(0.0, deadline - time.monotonic()),
            what=f"{what} to {peer!r} to complete",
            backoff=REFIT_BACKOFF,
            error=RefitTimeoutError,
            sleep=precise_sleep,
        )

    def prepare_writes(
        self,
        peer: str,
        local: Sequence[Region],
        remote: Sequence[Region],
        mem_type: str,
        groups: Sequence[Sequence[int]],
    ) -> PreparedWrites:
        """Prepare descriptor lists once and one WRITE handle per group of indices.

        ``local[i]`` is written to ``remote[i]``; each group (a bucket) becomes one handle
        that :meth:`post_prepared` posts again at every refit with a new notification.  The
        handles stay valid while both sides' memory stays registered.
        """
        if len(local) != len(remote):
            raise ValueError(f"need equal region lists, got {len(local)}/{len(remote)}")
        try:
            local_side = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", list(local), mem_type)
            remote_side = self._agent.prep_xfer_dlist(peer, list(remote), mem_type)
        except Exception as exc:  # nixl raises its own error types per status code
            raise PeerError(
                f"cannot prepare WRITEs to {peer!r}: {type(exc).__name__}: {exc}"
            ) from exc
        prepared = PreparedWrites(self, local_side, remote_side)
        try:
            for group in groups:
                indices = list(group)
                prepared.handles.append(
                    self._agent.make_prepped_xfer(
                        "WRITE", local_side, indices, remote_side, indices, b""
                    )
                    if indices
                    else None
                )
        except Exception as exc:  # nixl raises its own error types per status code
            prepared.release()
            raise PeerError(
                f"cannot prepare WRITEs to {peer!r}: {type(exc).__name__}: {exc}"
            ) from exc
        return prepared

    async def read(
        self,
        peer: str,
        local: Sequence[Region],
        remote: Sequence[Region],
        mem_type: str,
        *,
        what: str,
        deadline: float,
    ) -> None:
        """READ ``remote[i]`` of ``peer`` into ``local[i]`` (one-sided: the peer does
        nothing) and wait for it until ``deadline``; :class:`PeerError` if it fails."""
        if len(local) != len(remote):
            raise ValueError(f"need equal region lists, got {len(local)}/{len(remote)}")
        try:
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(list(local), mem_type),
                self._agent.get_xfer_descs(list(remote), mem_type),
                peer,
                b"",
            )
            state = self._agent.transfer(handle)
        except Exception as exc:  # nixl raises its own error types per status code
            raise PeerError(f"READ of {what} from {peer!r} failed: {_nixl(exc)}") from exc
        try:
            if state == "ERR":
                raise PeerError(f"READ of {what} from {peer!r} failed (peer gone?)")
            await self.wait_posted(handle, peer, what, deadline)
        finally:
            with contextlib.suppress(Exception):
                self._agent.release_xfer_handle(handle)

    def post_prepared(self, handle: Any, peer: str, notif: bytes) -> None:
        """Post a prepared WRITE handle (again) with notification ``notif``."""
        try:
            state = self._agent.transfer(handle, notif)
        except Exception as exc:  # a peer that died: nixl raises, e.g. RemoteDisconnect
            raise PeerError(f"posting a WRITE to {peer!r} failed: {_nixl(exc)}") from exc
        if state == "ERR":
            raise PeerError(f"posting a WRITE to {peer!r} failed")

    # -- messages -----------------------------------------------------------------------
    def send_control(self, peer: str, message: ControlMessage, *, who: str = "") -> None:
        """Send a control message; ``PeerError`` naming ``who`` (or the agent) if it fails."""
        try:
            self._agent.send_notif(peer, encode(message))
        except Exception as exc:  # nixl raises its own error types per status code
            raise PeerError(
                f"{who or 'peer'} (agent {peer!r}) unreachable while sending {message.kind} "
                f"of refit {message.refit}: {_nixl(exc)}"
            ) from exc

    def abort(self, peer: str, refit: int, reason: str) -> None:
        """Tell ``peer`` that refit ``refit`` failed here; best effort (it may be gone)."""
        with contextlib.suppress(Exception):
            self.send_control(peer, Abort(refit=refit, reason=reason[:2000]))
            self.flush()

    def flush(self, duration_s: float = 0.05) -> None:
        """Drive progress briefly so just-sent notifications leave before we stop polling.

        Without NIXL's progress thread, only our own calls move queued messages; a rank
        that sends its last message and returns would otherwise strand it.
        """
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            self.poll()
            time.sleep(0.002)

    def send_message(self, agent_name: str, message: dict[str, Any]) -> None:
        """Send a JSON object (upstream API; no pickle)."""
        self._agent.send_notif(agent_name, json.dumps(message).encode())

    def poll(self) -> None:
        """Move new notifications into the inbox (typed control ones by key)."""
        for peer_raw, items in self._agent.get_new_notifs().items():
            peer = peer_raw.decode() if isinstance(peer_raw, bytes) else str(peer_raw)
            for raw in items:
                data = bytes(raw)
                if not is_control(data):
                    self._raw.setdefault(peer, []).append(data)
                    continue
                message = decode(data)
                key = (peer, message.kind, message.refit, message.seq)
                if key in self._control and message.kind not in ("abort", "decline"):
                    raise ProtocolError(f"{peer!r} sent {message.kind} {key[2:]} twice")
                self._control[key] = message

    def forget_before(self, refit: int) -> None:
        """Drop control messages of refits before ``refit`` (late notifications)."""
        for key in [k for k in self._control if k[2] < refit]:
            log.debug("dropping stale %s from %s (refit %d)", key[1], key[0], key[2])
            del self._control[key]

    def take_control(self, peer: str, kind: str, refit: int, seq: int = 0) -> ControlMessage | None:
        self.poll()
        abort = self._control.get((peer, "abort", refit, 0))
        if isinstance(abort, Abort):
            raise PeerError(f"{peer!r} aborted refit {refit}: {abort.reason}")
        decline = self._control.get((peer, "decline", refit, 0))
        if isinstance(decline, Decline) and kind != "decline":
            error = WholeRefitWanted if decline.whole else DeclinedError
            raise error(f"{peer!r} declined refit {refit}: {decline.reason}")
        return self._control.pop((peer, kind, refit, seq), None)

    def pending(self, peer: str, kind: str) -> list[int]:
        """Refit ids of the ``kind`` messages from ``peer`` waiting in the inbox."""
        self.poll()
        return sorted(k[2] for k in self._control if k[0] == peer and k[1] == kind)

    def discard(self, peer: str, kind: str, refit: int, seq: int = 0) -> None:
        """Drop one message from the inbox (e.g. a manifest that was declined)."""
        self._control.pop((peer, kind, refit, seq), None)

    async def wait_control(
        self,
        peer: str,
        kind: str,
        refit: int,
        seq: int,
        *,
        what: str,
        deadline: float,
        backoff: Backoff = REFIT_BACKOFF,
    ) -> ControlMessage:
        """Wait for control message ``(kind, refit, seq)`` from ``peer``."""
        return await apoll_until(
            lambda: self.take_control(peer, kind, refit, seq),
            timeout=max(0.0, deadline - time.monotonic()),
            what=f"{what} from {peer!r}",
            backoff=backoff,
            error=RefitTimeoutError,
            sleep=precise_sleep,
        )

    async def read_message(self, agent_name: str, timeout: float = 60.0) -> dict[str, Any]:
        """The oldest JSON-object message from ``agent_name`` (see :meth:`send_message`)."""

        def oldest() -> dict[str, Any] | None:
            self.poll()
            pending = self._raw.get(agent_name, [])
            for index, raw in enumerate(pending):
                try:
                    value = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(value, dict):
                    del pending[index]
                    return value
            return None

        return await apoll_until(
            oldest,
            timeout=timeout,
            what=f"a message from {agent_name!r}",
            backoff=IDLE_BACKOFF,
            error=RefitTimeoutError,
            sleep=precise_sleep,
        )

    async def wait_notification(
        self, agent_name: str, notify_key: bytes, timeout: float = 60.0
    ) -> None:
        """Wait for the notification ``notify_key`` (exact bytes) from ``agent_name``."""

        def arrived() -> bool:
            self.poll()
            pending = self._raw.get(agent_name, [])
            if notify_key in pending:
                pending.remove(notify_key)
                return True
            return False

        await apoll_until(
            arrived,
            timeout=timeout,
            what=f"notification {notify_key!r} from {agent_name!r}",
            backoff=REFIT_BACKOFF,
            error=RefitTimeoutError,
            sleep=precise_sleep,
        )


class PreparedWrites:
    """Prepared descriptor lists and their per-bucket WRITE handles (see ``prepare_writes``)."""

    def __init__(self, agent: NixlAgent, local_side: Any, remote_side: Any) -> None:
        self._agent, self._local, self._remote = agent, local_side, remote_side
        self.handles: list[Any] = []

    def release(self) -> None:
        """Release the handles and lists; handles still in flight are left to NIXL's teardown."""
        for handle in self.handles:
            if handle is not None:
                with contextlib.suppress(Exception):
                    handle.release()
        self.handles = []
        for side in (self._local, self._remote):
            with contextlib.suppress(Exception):
                self._agent._agent.release_dlist_handle(side)


_PREINIT: NixlAgent | None = None


def preinit_nixl_agent(
    *,
    backend_name: str = NIXL_DEFAULT_BACKEND_NAME,
    backend_init_params: dict[str, Any] | None = None,
) -> NixlAgent:
    """Create the process's agent early (before heavy set-up); the next engine adopts it."""
    global _PREINIT  # noqa: PLW0603 - one agent per process, adopted by the engine
    if _PREINIT is None:
        _PREINIT = NixlAgent(backend_name, backend_init_params)
    return _PREINIT


def take_preinit_agent(
    backend_name: str, backend_init_params: dict[str, Any] | None
) -> NixlAgent | None:
    """Hand the pre-created agent to an engine when its backend settings match."""
    global _PREINIT  # noqa: PLW0603
    agent = _PREINIT
    if agent is None or agent.backend_name != backend_name:
        return None
    if agent.backend_init_params != dict(backend_init_params or {}):
        return None
    _PREINIT = None
    return agent


__all__ = [
    "IDLE_BACKOFF",
    "NIXL_DEFAULT_BACKEND_NAME",
    "NIXL_TRANSFER_BUFFER_COUNT",
    "REFIT_BACKOFF",
    "BucketReady",
    "Credit",
    "DeclinedError",
    "Done",
    "Manifest",
    "NixlAgent",
    "PeerError",
    "PreparedWrites",
    "RefitTimeoutError",
    "WholeRefitWanted",
    "preinit_nixl_agent",
    "resolve_nixl_backend_kwargs",
]
