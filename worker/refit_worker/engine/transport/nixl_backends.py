"""Backend settings for NIXL agents: names, init parameters and their validation.

Pure: turns the user's ``{"backend_name": ..., "backend_init_params": {...}}`` into what
``nixl_agent.create_backend`` takes (string values only), naming any bad value.
"""

from __future__ import annotations

from typing import Any

NIXL_DEFAULT_BACKEND_NAME = "UCX"
_NIXL_KWARGS = frozenset({"backend_name", "backend_init_params"})


def resolve_nixl_backend_kwargs(nixl_kwargs: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """Split ``{"backend_name": ..., "backend_init_params": {...}}`` into (name, params)."""
    if not isinstance(nixl_kwargs, dict):
        raise TypeError(f"nixl kwargs must be a dict, got {type(nixl_kwargs).__name__}")
    unknown = sorted(set(nixl_kwargs) - _NIXL_KWARGS)
    if unknown:
        raise ValueError(f"unknown nixl kwargs {unknown}; allowed: {sorted(_NIXL_KWARGS)}")
    name = nixl_kwargs.get("backend_name", NIXL_DEFAULT_BACKEND_NAME)
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend_name must be a non-empty string, got {name!r}")
    params = nixl_kwargs.get("backend_init_params")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"backend_init_params must be a dict, got {params!r}")
    return name, params


def backend_params(params: dict[str, Any] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in (params or {}).items():
        if isinstance(value, bool):
            out[str(key)] = "true" if value else "false"
        elif isinstance(value, str | int | float):
            out[str(key)] = str(value)
        else:
            raise ValueError(f"backend_init_params[{key!r}] must be a scalar, got {value!r}")
    return out


__all__ = ["NIXL_DEFAULT_BACKEND_NAME", "backend_params", "resolve_nixl_backend_kwargs"]
