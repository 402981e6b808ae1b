"""Membership-aware refits with real processes and real NIXL (UCX): one rollout rank's loss
or arrival never stops the others, and nothing restarts the policy rank.

Real: a process per rank, real NIXL agents, a real SIGKILL with ``os.kill`` mid-refit, a
new process (a new agent) joining between refits.  The test plays the rendezvous only.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests.support.membership_procs import Rank, expected_digests, set_peers

#: The policy gives up on a silent target after this; receivers are more patient, so a
#: survivor still waits while the sender drops a dead peer.
POLICY_TIMEOUT_S = 8.0
ROLLOUT_TIMEOUT_S = 60.0


@pytest.fixture
def started() -> Iterator[list[Rank]]:
    ranks: list[Rank] = []
    yield ranks
    for rank in ranks:
        rank.close()


def start(started: list[Rank], role: str, rank: int) -> Rank:
    timeout = POLICY_TIMEOUT_S if role == "policy" else ROLLOUT_TIMEOUT_S
    proc = Rank(role, rank, timeout_s=timeout)
    started.append(proc)
    return proc


def test_a_rollout_rank_killed_mid_refit_is_dropped_and_the_other_gets_it(started) -> None:
    policy = start(started, "policy", 0)
    r0, r1 = start(started, "rollout", 0), start(started, "rollout", 1)
    listing = [policy.prepare(), r0.prepare(), r1.prepare()]
    set_peers([policy, r0, r1], listing, T=1, R=2, versions={0: 1})
    r0.ask("receive", min_refit=0)
    r1.ask("receive", min_refit=0, hold_s=60)  # holds after its first batch: mid-refit
    policy.ask("send", refit=0)
    r1.event("first_batch")
    r1.kill()
    sent = policy.reply()
    assert "error" not in sent, sent["error"]
    assert sent["delivered"] == [0], sent
    assert list(sent["dropped"]) == ["1"] and "rollout rank 1" in sent["dropped"]["1"], sent
    got = r0.reply()
    assert "error" not in got, got["error"]
    assert got["refit_id"] == 0 and got["digests"] == expected_digests(0)
    # The same policy process goes on with the survivor once the membership says so.
    answers = set_peers([policy, r0], [listing[0], listing[1], None], T=1, R=2, versions={0: 2})
    assert answers[0]["removed"] == [["rollout", 1]] and answers[0]["added"] == []
    assert answers[1]["removed"] == answers[1]["added"] == []  # its sources did not change
    r0.ask("receive", min_refit=1)
    policy.ask("send", refit=1)
    sent = policy.reply()
    assert sent["delivered"] == [0] and sent["dropped"] == {}, sent
    got = r0.reply()
    assert got["refit_id"] == 1 and got["digests"] == expected_digests(1)


def test_a_new_rollout_process_joins_between_refits_and_gets_the_next_one(started) -> None:
    policy, r0 = start(started, "policy", 0), start(started, "rollout", 0)
    listing = [policy.prepare(), r0.prepare()]
    set_peers([policy, r0], listing, T=1, R=1, versions={0: 1})
    r0.ask("receive", min_refit=0)
    policy.ask("send", refit=0)
    assert policy.reply()["delivered"] == [0]
    assert r0.reply()["digests"] == expected_digests(0)
    # Scale up: a new process (a new NIXL agent) takes rollout rank 1; R grows to 2.
    r1 = start(started, "rollout", 1)
    listing = [*listing, r1.prepare()]
    answers = set_peers([policy, r0, r1], listing, T=1, R=2, versions={0: 2})
    assert answers[0]["added"] == [["rollout", 1]] and answers[0]["removed"] == []
    assert answers[1]["added"] == answers[1]["removed"] == []
    r0.ask("receive", min_refit=1)
    r1.ask("receive", min_refit=1)  # the joiner skips what it missed
    policy.ask("send", refit=1)
    sent = policy.reply()
    assert sent["delivered"] == [0, 1] and sent["dropped"] == {}, sent
    for rollout in (r0, r1):
        got = rollout.reply()
        assert "error" not in got, got["error"]
        assert got["refit_id"] == 1 and got["digests"] == expected_digests(1)


def test_an_older_refit_is_declined_and_the_sender_counts_it_not_delivered(started) -> None:
    policy, r0 = start(started, "policy", 0), start(started, "rollout", 0)
    listing = [policy.prepare(), r0.prepare()]
    set_peers([policy, r0], listing, T=1, R=1, versions={0: 1})
    r0.ask("receive", min_refit=5)
    policy.ask("send", refit=4)
    sent = policy.reply()
    assert "error" not in sent, sent["error"]
    assert sent["delivered"] == [] and sent["bytes"] == 0, sent
    assert "declined refit 4" in sent["dropped"]["0"], sent
    assert "waits for refit 5 or later" in sent["dropped"]["0"], sent
    policy.ask("send", refit=5)
    assert policy.reply()["delivered"] == [0]
    got = r0.reply()
    assert got["refit_id"] == 5 and got["digests"] == expected_digests(5)


def test_sources_that_disagree_on_the_membership_are_declined_then_the_next_refit_lands(
    started,
) -> None:
    p0, p1 = start(started, "policy", 0), start(started, "policy", 1)
    r0 = start(started, "rollout", 0)
    listing = [p0.prepare(), p1.prepare(), r0.prepare()]
    # Striping (T=2 > R=1): both policy ranks send to rollout rank 0, but one of them read
    # an older membership version.
    set_peers([p0, p1, r0], listing, T=2, R=1, versions={0: 3, 1: 4})
    r0.ask("receive", min_refit=0)
    p0.ask("send", refit=0)
    p1.ask("send", refit=0)
    for policy in (p0, p1):
        sent = policy.reply()
        assert "error" not in sent, sent["error"]
        assert sent["delivered"] == [] and "declined refit 0" in sent["dropped"]["0"], sent
        assert "different memberships" in sent["dropped"]["0"], sent
    set_peers([p0], listing, T=2, R=1, versions={0: 4})
    p0.ask("send", refit=1)
    p1.ask("send", refit=1)
    assert p0.reply()["delivered"] == [0] and p1.reply()["delivered"] == [0]
    got = r0.reply()
    assert "error" not in got, got["error"]
    assert got["refit_id"] == 1 and got["digests"] == expected_digests(1)


def test_a_target_dropped_and_relisted_before_it_noticed_gets_its_landing_sets_again(
    started,
) -> None:
    # Under load a rank can be removed from the membership and listed again (same pod)
    # before it reads either barrier: the policy forgot it, and the landing sets it was
    # sent, while the rank still thinks they are known.  Its next Ready then named a
    # landing set the policy never had, and the refit failed on both sides.
    policy, r0 = start(started, "policy", 0), start(started, "rollout", 0)
    listing = [policy.prepare(), r0.prepare()]
    set_peers([policy, r0], listing, T=1, R=1, versions={0: 1})
    for refit in (0, 1):  # the second refit reuses the landing set sent with the first
        r0.ask("receive", min_refit=refit)
        policy.ask("send", refit=refit)
        assert policy.reply()["delivered"] == [0]
        assert r0.reply()["digests"] == expected_digests(refit)
    gone = set_peers([policy], [listing[0], None], T=1, R=1, versions={0: 2})
    assert gone[0]["removed"] == [["rollout", 0]]
    back = set_peers([policy], listing, T=1, R=1, versions={0: 3})
    assert back[0]["added"] == [["rollout", 0]]
    r0.ask("receive", min_refit=2)
    policy.ask("send", refit=2)
    sent = policy.reply()
    assert "error" not in sent, sent["error"]
    assert sent["delivered"] == [0] and sent["dropped"] == {}, sent
    got = r0.reply()
    assert "error" not in got, got["error"]
    assert got["refit_id"] == 2 and got["digests"] == expected_digests(2)
