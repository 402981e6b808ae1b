"""Where each rendezvous key lives: the job's ConfigMaps (shards), one for the
operator's own keys and the rest by role, so that each party may be granted a patch of
its own maps alone (docs/security.md).

- Shard 0, ``<base>``: the operator's keys (``barrier``, ``preempt``).  Workers only
  read it.
- Then the policy role's maps, ``<base>-policy``, ``<base>-policy-1``, ...: ranks cut
  into blocks of :data:`RANKS_PER_SHARD` by rank.
- Then the rollout role's, ``<base>-rollout``, ``<base>-rollout-1``, ...

A map's name says which keys it may hold, whatever the world sizes (a rank's block is
``rank // RANKS_PER_SHARD``); readers take a key only from the map it belongs in
(:func:`at_home`), so an entry a pod writes into a map of its own names no one else.
Shard indices (the stores' numbering) put the policy blocks first, so scaling the
rollout role moves no existing key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.entries import (
    MAX_RANKS,
    RANKS_PER_SHARD,
    is_valid_data_key,
    parse_key,
    parse_known_key,
)
from refit_worker.contract.roles import Role, check_role

#: The shard of the operator's keys (barrier, preemption notice).
CONTROL_SHARD = 0

#: A map's place: its role (None: the operator's map) and its block of ranks.
Place = tuple[Role | None, int]

_NAME_RE = re.compile(r"-rendezvous(?:-(policy|rollout)(?:-([1-9][0-9]{0,8}))?)?$")


def _blocks(ranks: int) -> int:
    return math.ceil(ranks / RANKS_PER_SHARD)


def shards_needed(policy_world_size: int, rollout_world_size: int) -> int:
    """How many ConfigMaps a job spreads over: the operator's, then each role's blocks."""
    total = policy_world_size + rollout_world_size
    if policy_world_size < 1 or rollout_world_size < 1:
        raise ValueError(
            f"world sizes must be >= 1, got policy={policy_world_size} rollout={rollout_world_size}"
        )
    if total > MAX_RANKS:
        raise ValueError(f"total ranks {total} is outside 1..{MAX_RANKS}")
    return 1 + _blocks(policy_world_size) + _blocks(rollout_world_size)


def shard_of(
    role: Role, rank: int, policy_world_size: int, rollout_world_size: int, shards: int
) -> int:
    """The shard holding the per-rank keys of ``role`` rank ``rank``."""
    world = policy_world_size if check_role(role) == "policy" else rollout_world_size
    needed = shards_needed(policy_world_size, rollout_world_size)
    if not 0 <= rank < world:
        raise ValueError(f"{role} rank {rank} is outside world size {world}")
    if shards < needed:
        total = policy_world_size + rollout_world_size
        raise ValueError(f"shards={shards} is too few for {total} ranks (need {needed})")
    return _index((role, rank // RANKS_PER_SHARD), policy_world_size)


def _index(place: Place, policy_world_size: int) -> int:
    role, block = place
    if role is None:
        return CONTROL_SHARD
    return 1 + block + (_blocks(policy_world_size) if role == "rollout" else 0)


def place_of_shard(shard: int, policy_world_size: int) -> Place:
    """The role and block of shard ``shard`` (its map's name says the same)."""
    if shard < 0:
        raise ValueError(f"shard {shard} is negative")
    if shard == CONTROL_SHARD:
        return (None, 0)
    policy_blocks = _blocks(policy_world_size)
    if shard <= policy_blocks:
        return ("policy", shard - 1)
    return ("rollout", shard - 1 - policy_blocks)


def home_of_key(key: str) -> Place | None:
    """Where ``key`` belongs (None: a key outside the protocol, which no reader takes)."""
    parsed = parse_key(key)
    if parsed is None:
        return None
    if parsed.role is None or parsed.rank is None:
        return (None, 0)
    return (parsed.role, parsed.rank // RANKS_PER_SHARD)


def place_name(base: str, place: Place) -> str:
    """The ConfigMap of ``place``: ``base``, ``<base>-<role>`` or ``<base>-<role>-<block>``."""
    if not base:
        raise ValueError("the rendezvous ConfigMap base name is empty")
    role, block = place
    if block < 0:
        raise ValueError(f"block {block} is negative")
    name = base if role is None else f"{base}-{check_role(role)}" + (f"-{block}" if block else "")
    if len(name) > 253:
        raise ValueError(f"ConfigMap name {name!r} is longer than 253 characters")
    return name


def place_of_name(name: str) -> Place | None:
    """The place a rendezvous map's name says (its base ends in ``-rendezvous``), or None
    for a name that is no rendezvous map's."""
    match = _NAME_RE.search(name)
    if match is None:
        return None
    role, block = match.groups()
    return (check_role(role) if role else None, int(block or 0))


def at_home(place: Place, data: Mapping[str, str]) -> dict[str, str]:
    """The keys of ``data`` that belong in the map of ``place``; any other key there was
    written by someone the map's rights do not speak for, and is not read."""
    return {k: v for k, v in data.items() if home_of_key(k) == place}


def shard_of_key(key: str, policy_world_size: int, rollout_world_size: int, shards: int) -> int:
    """The shard that holds ``key`` (barrier and preemption notice: the operator's)."""
    parsed = parse_known_key(key)
    if parsed.role is None or parsed.rank is None:
        return CONTROL_SHARD
    return shard_of(parsed.role, parsed.rank, policy_world_size, rollout_world_size, shards)


@dataclass(frozen=True, slots=True)
class Layout:
    """The shape of a job's rendezvous: world sizes and how many shards hold it.

    ``shards`` is at least what the world sizes need (the operator's map and each role's
    blocks): a smaller count (an older config's 1) is raised to it, since no key may go
    without a map.  A larger one is kept (maps of rollout ranks a scale-down left)."""

    policy_world_size: int
    rollout_world_size: int
    shards: int

    def __post_init__(self) -> None:
        needed = shards_needed(self.policy_world_size, self.rollout_world_size)
        if self.shards < 1:
            raise ValueError(f"shards={self.shards} must be >= 1")
        object.__setattr__(self, "shards", max(self.shards, needed))  # frozen: set once here

    @classmethod
    def from_config(cls, config: WorkerConfig) -> Layout:
        return cls(config.policy_world_size, config.rollout_world_size, config.rendezvous.shards)

    def shard_of(self, key: str) -> int:
        return shard_of_key(key, self.policy_world_size, self.rollout_world_size, self.shards)

    def place(self, shard: int) -> Place:
        return place_of_shard(shard, self.policy_world_size)

    def name(self, base: str, shard: int) -> str:
        """The ConfigMap of shard ``shard``."""
        return place_name(base, self.place(shard))

    def role_shards(self, role: Role) -> list[int]:
        """The shards holding ``role``'s ranks (of this layout's world sizes)."""
        return [s for s in range(self.shards) if self.place(s)[0] == role]

    def at_home(self, shard: int, data: Mapping[str, str]) -> dict[str, str]:
        return at_home(self.place(shard), data)


def merge_patch(key: str, value: str) -> dict[str, dict[str, str]]:
    """The JSON merge patch that sets ``key`` alone, leaving every other key as it is."""
    if not is_valid_data_key(key):
        raise ValueError(f"{key!r} is not a valid ConfigMap data key")
    return {"data": {key: value}}
