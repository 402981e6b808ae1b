"""Where each rendezvous key lives: the operator's map, then each role's maps by blocks of
ranks; readers take a key only from the map it belongs in.

Real: the pure placement functions of ``refit_worker.contract.shards``.  Emulated: nothing.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refit_worker.contract.rendezvous import (
    BARRIER_KEY,
    MAX_RANKS,
    PREEMPT_KEY,
    RANKS_PER_SHARD,
    Layout,
    at_home,
    home_of_key,
    meta_key,
    place_name,
    place_of_name,
    progress_key,
    shard_of,
    shard_of_key,
    shards_needed,
)


@pytest.mark.parametrize(
    ("policy", "rollout", "shards"),
    [
        (1, 1, 3),
        (RANKS_PER_SHARD, 1, 3),
        (RANKS_PER_SHARD + 1, 1, 4),
        (1, 2 * RANKS_PER_SHARD + 1, 5),
        (MAX_RANKS // 2, MAX_RANKS // 2, 1 + 2 * 21),
    ],
)
def test_shards_needed_counts_the_operators_map_and_each_roles_blocks(
    policy: int, rollout: int, shards: int
) -> None:
    assert shards_needed(policy, rollout) == shards


@pytest.mark.parametrize(
    ("policy", "rollout", "error"),
    [(0, 1, "world sizes must be >= 1"), (MAX_RANKS, 1, "total ranks 4097 is outside")],
)
def test_shards_needed_rejects_out_of_range(policy: int, rollout: int, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        shards_needed(policy, rollout)


@pytest.mark.parametrize(
    ("role", "rank", "policy", "rollout", "shard"),
    [
        ("policy", 0, 2, 2, 1),
        ("rollout", 0, 2, 2, 2),  # never in a policy map, even with room there
        ("policy", 100, 150, 1, 2),
        ("rollout", 0, 150, 1, 3),
        ("rollout", 250, 1, 300, 4),
    ],
)
def test_shard_of(role: str, rank: int, policy: int, rollout: int, shard: int) -> None:
    shards = shards_needed(policy, rollout)
    assert shard_of(role, rank, policy, rollout, shards) == shard  # type: ignore[arg-type]
    assert shard_of_key(meta_key(role, rank), policy, rollout, shards) == shard  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("role", "rank", "shards", "error"),
    [
        ("policy", 2, 3, "policy rank 2 is outside world size 2"),
        ("rollout", -1, 3, "rollout rank -1 is outside"),
        ("policy", 0, 2, "shards=2 is too few for 4 ranks"),
        ("critic", 0, 3, "role 'critic'"),
    ],
)
def test_shard_of_rejects_bad_input(role: str, rank: int, shards: int, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        shard_of(role, rank, 2, 2, shards)  # type: ignore[arg-type]


def test_the_operators_keys_live_in_shard_zero() -> None:
    assert shard_of_key(BARRIER_KEY, 600, 600, 13) == 0
    assert shard_of_key(PREEMPT_KEY, 600, 600, 13) == 0


@given(policy=st.integers(1, 1500), rollout=st.integers(1, 1500))
def test_no_map_holds_both_roles_and_no_block_is_over_capacity(policy: int, rollout: int) -> None:
    layout = Layout(policy, rollout, shards_needed(policy, rollout))
    for role, world in (("policy", policy), ("rollout", rollout)):
        assigned = [layout.shard_of(meta_key(role, r)) for r in range(world)]  # type: ignore[arg-type]
        assert set(assigned) == set(layout.role_shards(role))  # type: ignore[arg-type]
        assert max(assigned.count(s) for s in set(assigned)) <= RANKS_PER_SHARD
    assert not set(layout.role_shards("policy")) & set(layout.role_shards("rollout"))
    assert 0 not in layout.role_shards("policy") + layout.role_shards("rollout")


@given(policy=st.integers(1, 600), rollout=st.integers(1, 600), more=st.integers(1, 600))
def test_scaling_the_rollout_role_moves_no_existing_key(
    policy: int, rollout: int, more: int
) -> None:
    before = Layout(policy, rollout, shards_needed(policy, rollout))
    after = Layout(policy, rollout + more, shards_needed(policy, rollout + more))
    for role, world in (("policy", policy), ("rollout", rollout)):
        for rank in range(world):
            key = meta_key(role, rank)  # type: ignore[arg-type]
            assert before.shard_of(key) == after.shard_of(key)
            assert before.name("j", before.shard_of(key)) == after.name("j", after.shard_of(key))


@pytest.mark.parametrize(
    ("shard", "name"),
    [
        (0, "job-rendezvous"),
        (1, "job-rendezvous-policy"),
        (2, "job-rendezvous-policy-1"),
        (3, "job-rendezvous-rollout"),
        (4, "job-rendezvous-rollout-1"),
    ],
)
def test_each_shard_is_named_by_its_role_and_block(shard: int, name: str) -> None:
    layout = Layout(150, 150, 5)
    assert layout.name("job-rendezvous", shard) == name
    assert place_of_name(name) == layout.place(shard)


@pytest.mark.parametrize(
    ("name", "place"),
    [
        ("a-rendezvous-3-rendezvous", (None, 0)),  # a job name that looks like a map's
        ("x-rendezvous-policy-rendezvous-rollout-2", ("rollout", 2)),
        ("job-signing-key", None),
        ("job-rendezvous-critic", None),
        ("job-rendezvous-policy-0", None),  # block 0 has no suffix: not a name we write
    ],
)
def test_a_name_says_its_place_or_none(name: str, place: object) -> None:
    assert place_of_name(name) == place


@pytest.mark.parametrize(
    ("base", "place", "error"),
    [
        ("", (None, 0), "base name is empty"),
        ("job", ("policy", -1), "block -1 is negative"),
        ("x" * 250, ("rollout", 1), "longer than 253"),
    ],
)
def test_place_name_rejects_bad_input(base: str, place: object, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        place_name(base, place)  # type: ignore[arg-type]


def test_a_map_yields_only_the_keys_that_belong_in_it() -> None:
    data = {
        BARRIER_KEY: "forged",
        PREEMPT_KEY: "forged",
        meta_key("policy", 0): "forged",
        meta_key("rollout", 0): "own",
        progress_key("rollout", 1): "own",
        progress_key("rollout", RANKS_PER_SHARD): "another block",
        "annotation.tool": "ignored",
    }
    assert at_home(("rollout", 0), data) == {
        meta_key("rollout", 0): "own",
        progress_key("rollout", 1): "own",
    }
    assert at_home((None, 0), {BARRIER_KEY: "b", meta_key("policy", 0): "m"}) == {BARRIER_KEY: "b"}
    assert home_of_key("annotation.tool") is None
