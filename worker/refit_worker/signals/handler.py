"""Gang-wide preemption signals: ``DistributedSignalHandler`` and its collective helpers.

Same public names and signatures as ``nemo_automodel.components.training.signal_handler``
(``SignalLike``, ``resolve_signal``, ``all_gather_item``, ``get_device``,
``DistributedSignalHandler``), with these differences:

- ``signals_received()`` is a ``list[bool]`` in one process and across processes alike;
- ``all_gather_item(..., async_op=True)`` waits for the gather before reading its buffers;
- the device follows the backend of the group passed (mixed strings such as
  ``cpu:gloo,cuda:nccl`` included), and an unsupported backend is named in the error;
- entering off the main thread, or for a signal that cannot be caught, is a clear error;
- with ``pid_dir`` given (in a pod: ``REFIT_SIGNAL_PID_DIR``, which ``WorkerConfig`` and
  ``refit_worker.contract.env.Preemption`` read), entering registers the process for the
  preStop delivery command (``refit-signal``) and leaving removes it.  The handler itself
  reads no environment.

Signals are parsed by ``refit_worker.contract.signals``, the one parser the operator, the
CRD and ``refit-signal`` use too.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

from refit_worker.contract.signals import SignalLike, parse_signals, resolve_signal
from refit_worker.signals.pid_registry import register

__all__ = [
    "DistributedSignalHandler",
    "SignalLike",
    "all_gather_item",
    "device_for_backend",
    "get_device",
    "resolve_signal",
]

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def device_for_backend(backend: str, local_rank: int | None = None) -> torch.device:
    """The device for a small collective on a group with ``backend`` (pure).

    ``backend`` is what ``torch.distributed.get_backend`` returns: ``gloo``, ``nccl``, or a
    per-device list such as ``cpu:gloo,cuda:nccl``.  A CPU backend is preferred when there is
    one (no device sync for a one-element tensor); ``nccl`` gives ``cuda`` (``cuda:<local_rank>``
    when given).  Raises ``RuntimeError`` naming the backend when neither is present.
    """
    pairs: list[tuple[str, str]] = []
    for part in backend.split(","):
        device, sep, name = part.strip().partition(":")
        pairs.append((device.lower(), name.lower()) if sep else ("", device.lower()))
    if any(name == "gloo" and device in ("", "cpu") for device, name in pairs):
        return torch.device("cpu")
    if any(name == "nccl" and device in ("", "cuda") for device, name in pairs):
        return torch.device("cuda") if local_rank is None else torch.device("cuda", local_rank)
    raise RuntimeError(
        f"unsupported torch.distributed backend {backend!r}: need gloo (cpu) or nccl (cuda)"
    )


def get_device(
    local_rank: int | None = None, *, group: dist.ProcessGroup | None = None
) -> torch.device:
    """The device to gather on for ``group`` (default: the default group), by its backend."""
    # Without a group, upstream's own call: code that wraps or patches get_backend() with
    # no argument keeps working.
    backend = dist.get_backend() if group is None else dist.get_backend(group)
    return device_for_backend(str(backend), local_rank)


def all_gather_item(
    item: Any,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    local_rank: int | None = None,
) -> list[Any]:
    """Gather one scalar from every rank of ``group``; ``[item]`` when not distributed.

    With ``async_op=True`` the gather is started asynchronously but still completed before
    the results are read; the group's own timeout (set at ``init_process_group``) bounds it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return [item]
    # The default group the way upstream asks for it; another group by its own backend.
    if group is None:
        device, size = get_device(local_rank), dist.get_world_size()
    else:
        device, size = get_device(local_rank, group=group), dist.get_world_size(group)
    mine = torch.tensor([item], dtype=dtype, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(size)]
    work = dist.all_gather(gathered, mine, group=group, async_op=async_op)
    if work is not None:
        work.wait()  # never read a buffer the gather may still be writing
    return [tensor.item() for tensor in gathered]


class DistributedSignalHandler:
    """Context manager: notice a signal on any rank, so that all ranks stop together.

    Entering installs a handler for each signal that only raises a flag; a training loop
    calls :meth:`signals_received` at a step boundary (a collective over ``group``: every
    rank must call it at the same point) and stops when any entry is true.  Leaving
    restores the handlers found on entry.

    ``pid_dir``: a directory to register this process in while entered, so that
    ``refit-signal`` (a pod's preStop hook) can send it its signal; ``None`` or ``""`` for
    no registration.
    """

    def __init__(
        self,
        sig: SignalLike | Sequence[SignalLike] = signal.SIGTERM,
        group: dist.ProcessGroup | None = None,
        *,
        pid_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.sigs: tuple[signal.Signals, ...] = parse_signals(sig)
        self.group = group
        self.pid_dir = pid_dir or None
        self.original_handlers: dict[signal.Signals, _Handler] = {}
        #: Upstream's name for the flag: code written against upstream reads it.
        self._signal_received = False
        self._released = True
        self._registration: Path | None = None

    @property
    def sig(self) -> signal.Signals:
        """The first configured signal (kept for callers of the single-signal API)."""
        return self.sigs[0]

    def __enter__(self) -> DistributedSignalHandler:
        _require_main_thread("enter DistributedSignalHandler")
        if not self._released:
            raise RuntimeError("this DistributedSignalHandler is already entered")
        previous = {s: signal.getsignal(s) for s in self.sigs}
        self._signal_received = False
        try:
            for s in self.sigs:
                signal.signal(s, self._on_signal)
            self._registration = register(self.pid_dir, self.sigs) if self.pid_dir else None
        except BaseException:
            _restore(previous)  # a failed enter leaves the process as it found it
            raise
        self.original_handlers = previous
        self._released = False
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        self.release()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: anything more could run in the middle of a collective.
        self._signal_received = True

    @property
    def received(self) -> bool:
        """Whether this process got one of the signals (local; not a collective).

        For watchers that must not block, e.g. a thread that stops a transfer early.
        """
        return self._signal_received

    def signals_received(self) -> list[bool]:
        """Per rank of the group, whether it got a signal; ``[flag]`` when not distributed.

        A collective: every rank of the group must call it at the same step.
        """
        gathered = all_gather_item(int(self._signal_received), dtype=torch.uint8, group=self.group)
        return [bool(flag) for flag in gathered]

    def release(self) -> bool:
        """Restore the handlers found on entry; ``False`` if there was nothing to release."""
        if self._released:
            return False
        _require_main_thread("release DistributedSignalHandler")
        _restore(self.original_handlers)
        if self._registration is not None:
            self._registration.unlink(missing_ok=True)
            self._registration = None
        self._released = True
        return True


def _restore(handlers: dict[signal.Signals, _Handler]) -> None:
    for s, handler in handlers.items():
        # getsignal gives None for a handler installed outside Python; the default is the
        # closest thing signal.signal accepts.
        signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _require_main_thread(action: str) -> None:
    current = threading.current_thread()
    if current is not threading.main_thread():
        raise RuntimeError(
            f"cannot {action} on thread {current.name!r}: Python runs signal handlers only on"
            " the main thread, so the handler must be entered and released there"
        )
