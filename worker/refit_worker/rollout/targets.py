"""Where a rollout rank's refit lands: the tensors of the served state, or a spare copy.

:class:`RefitSession` receives into *final* tensors, never into a scratch copy that is then
cloned:

* ``in_place``: straight into the live tensors (a model's parameters) while the server has
  paused generation; 1x memory.  Until the last bucket is verified the live tensors hold a
  mix of two refits, so a failure part-way leaves them partial (:class:`PartialRefitError`).
* ``double_buffer``: into a spare copy of the same layout (allocated once, registered once);
  the commit swaps the spare and the served tensors, so readers never see a partial refit;
  2x memory.  A failure leaves the served tensors untouched.

A target is an ``nn.Module`` (its parameters, plus any buffer whose name was sent) or a
mutable mapping of names to tensors (a state dict).  Pure bookkeeping: nothing here talks to
NIXL.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Literal

import torch
from torch import nn

ReceiveMode = Literal["double_buffer", "in_place"]
RECEIVE_MODES: tuple[ReceiveMode, ...] = ("double_buffer", "in_place")
Target = nn.Module | MutableMapping[str, torch.Tensor]


class PartialRefitError(RuntimeError):
    """An in-place refit stopped part-way: the live weights now mix two refits.

    The caller must not serve them; the next refit that completes repairs them.
    """


def check_mode(mode: str) -> ReceiveMode:
    for known in RECEIVE_MODES:
        if mode == known:
            return known
    raise ValueError(f"mode must be one of {list(RECEIVE_MODES)}, got {mode!r}")


def live_tensors(target: Target, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The target's tensors for the sent ``names`` (data only, no autograd).

    A module gives all its parameters, and the buffers among ``names``; a parameter that
    was not sent stays in the result, so the layout check names it.
    """
    if isinstance(target, nn.Module):
        found = {name: p.detach() for name, p in target.named_parameters()}
        buffers = dict(target.named_buffers())
        found.update({n: buffers[n].detach() for n in names if n in buffers and n not in found})
        return found
    if isinstance(target, MutableMapping):
        return {name: t.detach() for name, t in target.items()}
    raise TypeError(
        f"receive into an nn.Module or a mutable mapping of tensors, not {type(target).__name__}"
    )


def _assign(target: Target, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Point ``target``'s ``name`` at ``tensor``'s memory; returns the memory it had."""
    if isinstance(target, nn.Module):
        owner = target.get_submodule(name.rpartition(".")[0]) if "." in name else target
        current = getattr(owner, name.rpartition(".")[2])
        if not isinstance(current, torch.Tensor):
            raise TypeError(f"{name!r} of the module is a {type(current).__name__}, not a tensor")
        old = current.data
        current.data = tensor
        return old
    old = target[name].detach()
    target[name] = tensor
    return old


class DoubleBuffer:
    """A target's served tensors and a spare copy; :meth:`swap` commits the spare."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._spare: dict[str, torch.Tensor] = {}

    def spare(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The spare copy for the sent ``names``, allocated on first use or a new layout."""
        live = live_tensors(self.target, names)
        if not self._fits(live):
            # Zero-filled: its pages are faulted in now, not by the NIC's first WRITE.
            self._spare = {name: torch.zeros_like(t) for name, t in live.items()}
        return self._spare

    def _fits(self, live: Mapping[str, torch.Tensor]) -> bool:
        spare = self._spare
        return spare.keys() == live.keys() and all(
            (s.dtype, s.shape, s.device) == (live[n].dtype, live[n].shape, live[n].device)
            for n, s in spare.items()
        )

    def swap(self) -> dict[str, torch.Tensor]:
        """Serve the spare (just filled) and keep the previously served memory as the spare.

        No await in between: to every task of the event loop the swap is all or nothing.
        Returns the newly served tensors.
        """
        filled = self._spare
        self._spare = {name: _assign(self.target, name, t) for name, t in filled.items()}
        return filled


class OwnState:
    """The session's own double-buffered state for :meth:`RefitSession.receive`."""

    def __init__(self) -> None:
        self.served: dict[str, torch.Tensor] = {}
        self._spare: dict[str, torch.Tensor] = {}

    def spare(
        self, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device
    ) -> dict[str, torch.Tensor]:
        """Memory for the sent layout (``name -> (shape, dtype)``), reused while it fits."""
        fits = self._spare.keys() == shapes.keys() and all(
            (tuple(t.shape), t.dtype) == shapes[n] for n, t in self._spare.items()
        )
        if not fits:
            # Zero-filled: its pages are faulted in now, not by the NIC's first WRITE.
            self._spare = {
                name: torch.zeros(shape, dtype=dtype, device=device)
                for name, (shape, dtype) in shapes.items()
            }
        return self._spare

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The served layout (``name -> (shape, dtype)``)."""
        return {name: (tuple(t.shape), t.dtype) for name, t in self.served.items()}

    def swap(self) -> dict[str, torch.Tensor]:
        self.served, self._spare = self._spare, self.served
        return self.served


__all__ = [
    "RECEIVE_MODES",
    "DoubleBuffer",
    "OwnState",
    "PartialRefitError",
    "ReceiveMode",
    "Target",
    "check_mode",
    "live_tensors",
]
