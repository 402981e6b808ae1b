"""A job's rendezvous as the API holds it: a flat ``key -> value`` map spread over the
ConfigMaps each key belongs in (the operator's map, each role's), as honest writers
leave it.  A key outside the protocol goes to the operator's map."""

from __future__ import annotations

from collections.abc import Mapping

from refit_worker.contract.rendezvous import home_of_key, place_name


def spread(job: str, data: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """``data`` by ConfigMap name; the operator's map is always there, even empty."""
    base = f"{job}-rendezvous"
    maps: dict[str, dict[str, str]] = {base: {}}
    for key, value in data.items():
        name = place_name(base, home_of_key(key) or (None, 0))
        maps.setdefault(name, {})[key] = value
    return maps
