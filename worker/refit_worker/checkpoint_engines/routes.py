"""What a policy rank keeps per target across refits: the :class:`Target` and its
:class:`Routes` (landing sets received on the connection, prepared WRITE handles by route,
the manifest built for the plan).

Must not import: torch, torch.distributed, the engine module (``nixl.py``), the operator.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .agent import PreparedWrites
from .layout import TargetWeightLayout
from .messages import BufferDesc, LandingSet, Manifest

_ROUTES_KEPT = 4  # double buffering alternates two landing sets; room for a layout change


@dataclass
class Target:
    """A rollout rank this policy rank writes to."""

    rank: int
    agent: str
    buffers: tuple[BufferDesc, ...]
    sources: tuple[int, ...]
    layout: TargetWeightLayout | None
    dev_id: int = 0


class Routes:
    """Per target: landing sets received on this connection, and prepared WRITEs by route.

    ``connection`` names this connection in every manifest: a target this rank forgot and
    found again (removed from the membership and relisted before the target noticed) sees
    a new one and sends its landing sets in full again, since none of them is known here.
    """

    def __init__(self) -> None:
        self.connection = secrets.token_hex(8)
        self.landing: dict[str, LandingSet] = {}
        self.manifests: dict[tuple[str, str | None], Manifest] = {}
        self._prepared: OrderedDict[tuple[Any, ...], PreparedWrites] = OrderedDict()
        #: Routes prepared (not reused), for the stats.
        self.built = 0

    def get(self, key: tuple[Any, ...]) -> PreparedWrites | None:
        found = self._prepared.get(key)
        if found is not None:
            self._prepared.move_to_end(key)
        return found

    def put(self, key: tuple[Any, ...], prepared: PreparedWrites) -> None:
        self.built += 1
        self._prepared[key] = prepared
        while len(self._prepared) > _ROUTES_KEPT:
            self._prepared.popitem(last=False)[1].release()

    def forget_prepared(self) -> None:
        for prepared in self._prepared.values():
            prepared.release()
        self._prepared.clear()

    def clear(self) -> None:
        self.forget_prepared()
        self.landing.clear()


__all__ = ["Routes", "Target"]
