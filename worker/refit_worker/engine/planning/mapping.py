"""Pure rank mapping: which policy ranks send which buckets to which rollout ranks.

One function decides it, :func:`source_ranks_for_rollout`; the others derive from it.
With ``T`` policy and ``R`` rollout ranks:

* ``T == R``: pairs, rollout ``r`` <- policy ``r`` (upstream's only mode);
* ``T > R`` (striping): rollout ``r`` <- every policy ``p`` with ``p % R == r``; the senders
  hold identical weights and take turns by bucket: bucket ``k`` comes from
  ``sources[k % len(sources)]``.  With ``stripe=False`` only ``p == r`` sends (upstream);
* ``T < R`` (fan-out): rollout ``r`` <- policy ``r % T``; each policy rank serves several
  rollout ranks, writing every bucket once per receiver from the same source memory.
"""

from __future__ import annotations


def check_world_sizes(train_world_size: object, rollout_world_size: object) -> None:
    """Raise naming the bad value unless both world sizes are positive ints."""
    for label, value in (
        ("train_world_size", train_world_size),
        ("rollout_world_size", rollout_world_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be an int >= 1, got {value!r}")


def _check_rank(label: str, rank: object, world_size: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"{label} must be an int in [0, {world_size}), got {rank!r}")
    return rank


def source_ranks_for_rollout(
    rollout_rank: int, *, train_world_size: int, rollout_world_size: int, stripe: bool = True
) -> tuple[int, ...]:
    """The policy ranks that send to ``rollout_rank``, in bucket turn order."""
    check_world_sizes(train_world_size, rollout_world_size)
    _check_rank("rollout_rank", rollout_rank, rollout_world_size)
    if train_world_size < rollout_world_size:
        return (rollout_rank % train_world_size,)
    if not stripe:
        return (rollout_rank,)
    return tuple(range(rollout_rank, train_world_size, rollout_world_size))


def _source_rank_for_rollout(
    rollout_rank: int, *, train_world_size: int, rollout_world_size: int
) -> int:
    """Upstream's name: the first (with ``stripe=False`` the only) sender of a rollout rank."""
    return source_ranks_for_rollout(
        rollout_rank,
        train_world_size=train_world_size,
        rollout_world_size=rollout_world_size,
        stripe=False,
    )[0]


def rollout_targets_for_policy(
    worker_rank: int, *, train_world_size: int, rollout_world_size: int, stripe: bool = True
) -> tuple[int, ...]:
    """The rollout ranks that ``worker_rank`` sends to (possibly none)."""
    check_world_sizes(train_world_size, rollout_world_size)
    _check_rank("worker_rank", worker_rank, train_world_size)
    return tuple(
        r
        for r in range(rollout_world_size)
        if worker_rank
        in source_ranks_for_rollout(
            r,
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            stripe=stripe,
        )
    )


def bucket_sender(seq: int, sources: tuple[int, ...]) -> int:
    """The policy rank (among a receiver's ``sources``) that sends bucket ``seq``."""
    if not sources:
        raise ValueError("a rollout rank needs at least one source rank")
    if seq < 0:
        raise ValueError(f"bucket sequence number must be >= 0, got {seq}")
    return sources[seq % len(sources)]
