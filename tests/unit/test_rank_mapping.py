"""Rank mapping, table-tested.  Pure: no processes, no NIXL."""

from __future__ import annotations

import pytest

from refit_worker.engine.planning.mapping import (
    _source_rank_for_rollout,
    bucket_sender,
    rollout_targets_for_policy,
    source_ranks_for_rollout,
)


@pytest.mark.parametrize(
    ("train", "rollout", "stripe", "want"),
    [
        (1, 1, True, [(0,)]),
        (2, 2, True, [(0,), (1,)]),
        (3, 2, True, [(0, 2), (1,)]),
        (4, 2, True, [(0, 2), (1, 3)]),
        (4, 2, False, [(0,), (1,)]),
        (1, 3, True, [(0,), (0,), (0,)]),
        (2, 3, True, [(0,), (1,), (0,)]),
        (2, 5, False, [(0,), (1,), (0,), (1,), (0,)]),
    ],
)
def test_sources_table(train, rollout, stripe, want) -> None:
    got = [
        source_ranks_for_rollout(
            r, train_world_size=train, rollout_world_size=rollout, stripe=stripe
        )
        for r in range(rollout)
    ]
    assert got == want


@pytest.mark.parametrize(("train", "rollout"), [(1, 1), (3, 2), (2, 3), (5, 2), (1, 4)])
def test_targets_are_the_inverse_and_every_rollout_is_served(train, rollout) -> None:
    served = set()
    for p in range(train):
        for r in rollout_targets_for_policy(p, train_world_size=train, rollout_world_size=rollout):
            assert p in source_ranks_for_rollout(
                r, train_world_size=train, rollout_world_size=rollout
            )
            served.add(r)
    assert served == set(range(rollout))


def test_upstream_single_source() -> None:
    assert _source_rank_for_rollout(1, train_world_size=4, rollout_world_size=2) == 1
    assert _source_rank_for_rollout(2, train_world_size=2, rollout_world_size=3) == 0


def test_bucket_turns() -> None:
    assert [bucket_sender(k, (0, 2)) for k in range(5)] == [0, 2, 0, 2, 0]
    with pytest.raises(ValueError, match="at least one source"):
        bucket_sender(0, ())
    with pytest.raises(ValueError, match="got -1"):
        bucket_sender(-1, (0,))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"rollout_rank": 0, "train_world_size": 0, "rollout_world_size": 1},
            "train_world_size must be an int >= 1, got 0",
        ),
        (
            {"rollout_rank": 0, "train_world_size": 1, "rollout_world_size": True},
            "rollout_world_size must be an int >= 1, got True",
        ),
        (
            {"rollout_rank": 2, "train_world_size": 1, "rollout_world_size": 2},
            r"rollout_rank must be an int in \[0, 2\), got 2",
        ),
    ],
)
def test_bad_input_named(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        source_ranks_for_rollout(**kwargs)
