"""What a policy rank keeps per target across refits: its :class:`Routes` (landing sets
received on the connection, prepared WRITE handles by route, the manifest built for the plan).
The target itself (:class:`~refit_worker.engine.transport.peers.Target`) comes from the peers.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from typing import Any

from ..messages.wire import LandingSet, Manifest
from ..transport.agent import PreparedWrites

_ROUTES_KEPT = 4  # double buffering alternates two landing sets; room for a layout change


class Routes:
    """Per target: landing sets received on this connection, and prepared WRITEs by route.

    ``connection`` names this connection in every manifest: a target this rank forgot and
    found again (removed from the membership and relisted before the target noticed) sees
    a new one and sends its landing sets in full again, since none of them is known here.
    """

    def __init__(self) -> None:
        self.connection = secrets.token_hex(8)
        self.landing: dict[str, LandingSet] = {}
        #: Landing sets whose NIXL metadata is loaded since the peer was (re)loaded, and the
        #: registrations that metadata described, by (addr, nbytes, dev_id).
        self.loaded: set[str] = set()
        self.regions: dict[tuple[int, int, int], int] = {}
        self.manifests: dict[tuple[str, str | None], Manifest] = {}
        self._prepared: OrderedDict[tuple[Any, ...], PreparedWrites] = OrderedDict()
        #: Routes prepared (not reused), for the stats.
        self.built = 0

    def stale(self, landing: LandingSet) -> bool:
        """Whether ``landing``'s memory was loaded here before as other registrations.

        NIXL keeps every remote region it loaded and never replaces one: a region loaded
        again with a new registration keeps the old one, and an old region lying inside a
        newer, larger one hides it from lookups that start past it (NIXL_ERR_NOT_FOUND when
        the WRITEs are prepared).  Both happen when the peer lands a new layout in memory an
        older landing set used (a layout change reallocates its tensors, and its allocator
        hands out memory freed by a sweep or still registered under the old layout)."""
        for region in landing.regions:
            key = (region.addr, region.nbytes, region.dev_id)
            known = self.regions.get(key)
            if known is not None:
                if known != region.registration:
                    return True
                continue
            if any(_overlap(key, other) for other in self.regions):
                return True
        return False

    def loaded_now(self, landing: LandingSet) -> None:
        self.loaded.add(landing.id)
        for region in landing.regions:
            self.regions[(region.addr, region.nbytes, region.dev_id)] = region.registration

    def forget_remote(self) -> None:
        """The peer's metadata was loaded again: nothing of its memory is loaded."""
        self.forget_prepared()
        self.loaded.clear()
        self.regions.clear()

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
        self.loaded.clear()
        self.regions.clear()


def _overlap(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    return a[2] == b[2] and a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


__all__ = ["Routes"]
