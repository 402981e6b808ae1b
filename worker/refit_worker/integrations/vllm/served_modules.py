"""Which checkpoint tensors a landing of a delta refit must reload: whole vLLM modules.

vLLM's in-place reload rebuilds every module it is given a tensor for from fresh memory
and loads into it only what it was given, while a module given nothing keeps what it
serves (``bench/vllm_subset_reload.py`` measured both on vLLM 0.32).  A module may fuse
several checkpoint tensors: q/k/v stacked into ``qkv_proj``, gate/up into
``gate_up_proj``, all of a layer's experts into ``w13``/``w2``.  Given q alone it would
serve garbage for k and v.  So the tensors a delta changed are widened to every tensor of
each module they feed: :func:`landing_set`.

A module is found by walking up the served parameter name (the model's own HF->vLLM
mapping, which does the stacking) to the deepest module that exists; a per-expert
checkpoint name has no module of its own, so it lands in its layer's fused experts.  A
mapping that renames less than it should only makes the group coarser, never finer: the
widening errs towards reloading more.  The landing reads every served layer back
afterwards either way.

Pure: names only (a contract in pyproject.toml keeps vLLM and torch out).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass

#: Checkpoint (HF) name -> the served parameter name; None: the engine drops the tensor.
ServedName = Callable[[str], str | None]


@dataclass(frozen=True)
class LandingSet:
    """What one landing reloads."""

    #: Checkpoint names to hand to the reload.
    names: frozenset[str]
    #: The engine's modules those rebuild (their one-time processing must be redone).
    modules: frozenset[str]


def _enclosing(name: str) -> Iterator[str]:
    """``name`` and every dotted prefix of it, deepest first."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        yield ".".join(parts[:end])


def owner(param: str, modules: Collection[str]) -> str | None:
    """The deepest of ``modules`` that holds the parameter named ``param`` (None: none
    of them; the root module is not a group)."""
    parent = param.rpartition(".")[0]
    return next((m for m in _enclosing(parent) if m in modules), None) if parent else None


def landing_set(
    names: Iterable[str],
    changed: Collection[str],
    served_name: ServedName,
    modules: Collection[str],
) -> LandingSet:
    """Every one of ``names`` that feeds a module one of ``changed`` feeds, and those
    modules.  A tensor that maps to no module (dropped by the engine, or a parameter of
    the root) is its own group."""
    group: dict[str, str] = {}
    for name in names:
        mapped = served_name(name)
        module = owner(mapped, modules) if mapped is not None else None
        # The "=" prefix cannot begin a module name: a lone tensor's group stays its own.
        group[name] = module if module is not None else f"={name}"
    touched = {group[n] for n in changed if n in group}
    return LandingSet(
        names=frozenset(n for n, g in group.items() if g in touched),
        modules=frozenset(g for g in touched if not g.startswith("=")),
    )


def within(module: str, roots: Collection[str]) -> bool:
    """Whether ``module`` is one of ``roots`` or lies inside one (a walk up its own name:
    called for every module of the model, so it must not scan ``roots``)."""
    return any(m in roots for m in _enclosing(module))
