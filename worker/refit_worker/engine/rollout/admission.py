"""The rollout side's admission of a refit: which manifest to take, and declining the rest.

A receiver takes the first manifest of refit id ``>= k`` (or exactly ``k``) from any of its
policy peers; with ``min_refit`` it declines manifests of older refits instead of letting
their senders wait.  It then collects the manifests of the same refit from every source
:func:`~refit_worker.engine.transport.peers.expected_sources` names, for at most half the timeout
(so that a decline reaches the present senders before their own wait for ``ready`` runs out), and
declines the refit when one is missing or they disagree
(:func:`~refit_worker.engine.transport.peers.disagreement`). Nothing lands before a refit is
admitted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

from refit_worker.contract.waits import apoll_until, precise_sleep

from ..messages.wire import Decline, Manifest
from ..transport.agent import IDLE_BACKOFF, REFIT_BACKOFF, NixlAgent, PeerError, RefitTimeoutError


class RefitDeclinedError(RuntimeError):
    """This rollout rank declined refit ``refit`` (nothing landed); ``reason`` says why."""

    def __init__(self, refit: int, reason: str, *, whole: bool = False) -> None:
        super().__init__(f"declined refit {refit}: {reason}")
        #: ``whole``: it declined a delta and still takes this refit, whole.
        self.refit, self.reason, self.whole = refit, reason, whole


class Decliner:
    """Sends ``decline`` at most once per (peer, refit); best effort (the peer may be gone)."""

    def __init__(self, agent: NixlAgent, rank: int, sent: set[tuple[str, int]]) -> None:
        self.agent, self.rank, self.sent = agent, rank, sent

    def __call__(self, peer: str, refit: int, reason: str, *, whole: bool = False) -> None:
        # A delta declined for the whole refit is answered by a new send of the same id,
        # which may need a decline of its own: only plain declines are sent once.
        if (peer, refit) in self.sent:
            return
        if not whole:
            self.sent.add((peer, refit))
        with contextlib.suppress(PeerError):
            self.agent.send_control(
                peer,
                Decline(
                    refit=refit, reason=f"rollout rank {self.rank}: {reason}"[:2000], whole=whole
                ),
                who=f"rollout rank {self.rank}",
            )


async def first_manifest(
    agent: NixlAgent,
    peers: Callable[[], Mapping[int, str]],
    *,
    refit: int,
    exact: bool,
    timeout_s: float,
    who: str,
    decline: Decliner,
) -> tuple[int, object]:
    """``(policy rank, message)`` of the lowest refit ``>= refit`` (``exact``: ``== refit``)
    that any peer sent a manifest for; older ones are declined (``exact``: dropped)."""

    def look() -> tuple[int, object] | None:
        best: tuple[int, int] | None = None
        for rank, peer in peers().items():
            for found in agent.pending(peer, "manifest"):
                if found < refit:
                    if not exact:
                        decline(peer, found, f"it waits for refit {refit} or later")
                    agent.discard(peer, "manifest", found)
                elif (found == refit or not exact) and (best is None or found < best[0]):
                    best = (found, rank)
        if best is None:
            return None
        message = agent.take_control(peers()[best[1]], "manifest", best[0])
        return None if message is None else (best[1], message)

    ranks = ", ".join(str(rank) for rank in sorted(peers())) or "none connected"
    wanted = "the manifest" if exact else f"the manifest of refit {refit} or later"
    return await apoll_until(
        look,
        timeout=timeout_s,
        what=f"{who}: {wanted} (policy rank {ranks}, within {timeout_s}s)",
        backoff=IDLE_BACKOFF,
        error=RefitTimeoutError,
        sleep=precise_sleep,
    )


async def other_manifests(
    agent: NixlAgent, peers: Mapping[int, str | None], *, refit: int, wait_s: float
) -> dict[int, Manifest | None]:
    """The manifests of refit ``refit`` from ``peers`` (None: not connected) that arrive
    within ``wait_s``; a missing one is None."""
    got: dict[int, Manifest | None] = dict.fromkeys(peers)

    def complete() -> bool:
        for rank, peer in peers.items():
            if got[rank] is None and peer is not None:
                found = agent.take_control(peer, "manifest", refit)
                if isinstance(found, Manifest):
                    got[rank] = found
        return all(got[rank] is not None for rank, peer in peers.items() if peer is not None)

    with contextlib.suppress(RefitTimeoutError):
        await apoll_until(
            complete,
            timeout=wait_s,
            what=f"the manifests of refit {refit} from policy ranks {sorted(peers)}",
            backoff=REFIT_BACKOFF,
            error=RefitTimeoutError,
            sleep=precise_sleep,
        )
    return got


__all__ = ["Decliner", "RefitDeclinedError", "first_manifest", "other_manifests"]
