"""When a policy rank must forget what it loaded of a rollout's memory (``Routes.stale``).

NIXL keeps every remote region it loaded and never replaces one, so landing memory that the
rollout registered again, or registered around memory it registered before, must not be
loaded over the old regions (the qwen2-moe NIXL_ERR_NOT_FOUND of docs/engines.md)."""

from __future__ import annotations

from refit_worker.engine.messages.wire import LandingRegion, LandingSet, LandingTensor
from refit_worker.engine.policy.routes import Routes


def _set(ident: str, *regions: tuple[int, int, int]) -> LandingSet:
    return LandingSet(
        id=ident,
        metadata=b"m",
        tensors=(LandingTensor(name="w", nbytes=regions[0][1], addr=regions[0][0]),),
        regions=tuple(
            LandingRegion(addr=a, nbytes=n, registration=serial) for a, n, serial in regions
        ),
    )


def test_only_memory_loaded_before_as_another_registration_is_stale() -> None:
    routes = Routes()
    first = _set("a", (4096, 4096, 1), (16384, 4096, 2))
    assert not routes.stale(first)  # nothing loaded yet
    routes.loaded_now(first)
    # Double buffering: the other copy elsewhere, and the same registrations again.
    assert not routes.stale(_set("b", (65536, 8192, 3)))
    assert not routes.stale(_set("c", (4096, 4096, 1)))
    # The same memory registered again (swept, then reused): NIXL would keep the old one.
    assert routes.stale(_set("d", (4096, 4096, 7)))
    # New memory around the old: the old region would hide it from lookups past it.
    assert routes.stale(_set("e", (0, 1 << 20, 8)))
    assert routes.stale(_set("f", (8000, 200, 9)))  # straddles the first region's end
    assert not routes.stale(_set("g", (8192, 8192, 10)))  # touches, does not overlap
    routes.forget_remote()  # the peer's metadata loaded again: nothing of it is loaded
    assert not routes.stale(_set("e", (0, 1 << 20, 8))) and not routes.loaded
