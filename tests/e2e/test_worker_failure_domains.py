"""Failure domains, worker side, as real processes: a rollout rank SIGKILLed and replaced
while the policy keeps running; the policy killed and recreated in a new epoch while the
rollout ranks keep theirs; a late joiner served by the lingering policy; a scale-down
(the removed rank reports ``left`` and exits 0); a stale pod that finds its rank held by
its replacement (it exits as preempted and writes nothing under the rank's key); two
policy ranks sending 900 refits by one plan while R changes 20 times and a member is
SIGKILLed and replaced halfway.

Every rank is a real ``refit-worker`` process (real gloo for the policy gang, real NIXL
over UCX, the file-backed rendezvous store); the test plays the operator: it keeps which
pod holds each rank, and writes the barrier the contract's ``membership()`` decides
(``tests/support/demo_job.py``).  Kills are real ``os.kill`` signals.
"""

from __future__ import annotations

import re
from itertools import pairwise
from pathlib import Path

from tests.support.demo_job import DemoJob, Pod
from tests.support.fault_runs import committed_refits, sent_refits

from refit_worker.contract.exits import EXIT_PREEMPTED

# Enough refits that the run is still going when the test acts on it.
LONG_RUN = 300


def _committed(pod: Pod) -> list[int]:
    """The refit ids ``pod`` committed, from its log (each after the bit-exact check)."""
    return [int(m) for m in re.findall(r"refit (\d+) committed", pod.log.read_text())]


def _report(job: DemoJob, pod: Pod) -> object:
    report = job.progress().get((pod.role, pod.rank))
    return report if report is not None and report.uid == pod.uid else None  # type: ignore[attr-defined]


def _done(job: DemoJob, pod: Pod) -> bool:
    report = _report(job, pod)
    return report is not None and report.state == "done"  # type: ignore[attr-defined]


def _committed_at_least(job: DemoJob, pod: Pod, count: int) -> bool:
    report = _report(job, pod)
    return report is not None and report.refits_completed >= count  # type: ignore[attr-defined]


def _finish(job: DemoJob, pods: list[Pod], timeout: float = 240.0) -> list[int | None]:
    job.wait_for("every pod to exit", lambda: all(p.proc.poll() is not None for p in pods), timeout)
    return [p.proc.returncode for p in pods]


def test_a_killed_rollout_rank_is_replaced_alone(tmp_path: Path) -> None:
    with DemoJob(tmp_path, policy=1, rollout=2, refits=LONG_RUN) as job:
        policy = job.start("policy", 0)
        first = [job.start("rollout", r) for r in range(2)]
        job.wait_for(
            "rollout rank 1 to commit 5 refits", lambda: _committed_at_least(job, first[1], 5)
        )
        job.kill(first[1])  # mid-run: the policy is sending the next refits
        killed_at = job.progress()[("policy", 0)].refits_completed  # type: ignore[attr-defined]
        replacement = job.start("rollout", 1, generation=1, first_refit=killed_at)
        codes = _finish(job, [policy, first[0], replacement])
        assert codes == [0, 0, 0], job.logs()
        assert first[1].proc.returncode == -9
        # The policy never restarted: one process, the one started first, in epoch 0.
        assert [p for p in job.gone if p.role == "policy"] == []
        assert job.pods[("policy", 0)] is policy and job.epoch == 0
        for pod in (first[0], replacement):
            report = _report(job, pod)
            assert report is not None, job.logs()
            assert (report.state, report.refits_completed, report.verification) == (  # type: ignore[attr-defined]
                "done",
                LONG_RUN,
                "bit-exact",
            ), job.logs()
        got = _committed(replacement)
        # It joined at a refit boundary: refits from its first_refit on, in order, the
        # last one included, each committed after the bit-exact check.
        assert got and got[0] >= killed_at and got[-1] == LONG_RUN - 1, got
        assert got == sorted(set(got)), got
        assert _committed(first[0]) == list(range(LONG_RUN))
        # The membership went: both members, rank 1 gone, rank 1 = the replacement.
        slots = [tuple(s.uid if s else None for s in b.rollout) for b in job.barriers]
        assert (first[0].uid, None) in slots and (first[0].uid, replacement.uid) in slots, slots


def test_a_killed_policy_restarts_alone_and_rollout_ranks_rejoin(tmp_path: Path) -> None:
    with DemoJob(tmp_path, policy=1, rollout=2, refits=LONG_RUN) as job:
        old_policy = job.start("policy", 0)
        rollout = [job.start("rollout", r) for r in range(2)]
        job.wait_for(
            "both rollout ranks to commit 5 refits",
            lambda: all(_committed_at_least(job, p, 5) for p in rollout),
        )
        job.kill(old_policy)
        resume = min(_report(job, p).refits_completed for p in rollout)  # type: ignore[union-attr]
        (new_policy,) = job.new_policy_epoch(first_refit=resume)
        codes = _finish(job, [new_policy, *rollout])
        assert codes == [0, 0, 0], job.logs()
        for pod in rollout:
            # Same processes throughout: their pids never changed, they rejoined epoch 1.
            assert job.pods[("rollout", pod.rank)] is pod
            report = _report(job, pod)
            assert report is not None
            assert (report.state, report.refits_completed, report.epoch) == ("done", LONG_RUN, 1)  # type: ignore[attr-defined]
            got = _committed(pod)
            assert got == sorted(set(got)) and got[-1] == LONG_RUN - 1, got
            assert "joining policy epoch 1" in pod.log.read_text()
        assert _report(job, new_policy).state == "done"  # type: ignore[union-attr]


def test_a_late_joiner_gets_the_last_refit_from_a_peer_that_stays(tmp_path: Path) -> None:
    """After the last refit the rollout rank that committed it stays, offering it; the
    policy rank sees that and stops lingering; a rank that joins late is seeded by the
    one that stayed (issue #31), bit-exact, and then every rank ends."""
    refits = 4
    with DemoJob(tmp_path, policy=1, rollout=2, refits=refits) as job:
        policy = job.start("policy", 0)
        early = job.start("rollout", 0)  # rank 1 has no pod yet: the barrier lists rank 0
        job.wait_for("rollout rank 0 to be done", lambda: _done(job, early))
        assert early.proc.poll() is None, job.logs()  # staying: slot 1 is not done
        late = job.start("rollout", 1)
        codes = _finish(job, [policy, early, late])
        assert codes == [0, 0, 0], job.logs()
        assert _committed(early) == list(range(refits))
        # The joiner skipped what it missed and took the last refit, bit-exact.
        assert _committed(late) == [refits - 1], job.logs()
        report = _report(job, late)
        assert report is not None
        assert (report.state, report.refits_completed, report.verification) == (  # type: ignore[attr-defined]
            "done",
            refits,
            "bit-exact",
        )
        assert report.seed is not None and report.seed.source == "rollout-0", report  # type: ignore[attr-defined]
        assert report.bytes_total == 0, report  # type: ignore[attr-defined]  # none from the policy
        assert "rollout-0 stays to seed late members" in policy.log.read_text()
        assert "again" not in policy.log.read_text()


def test_a_scale_down_removes_a_rank_at_a_refit_boundary(tmp_path: Path) -> None:
    with DemoJob(tmp_path, policy=1, rollout=2, refits=LONG_RUN) as job:
        policy = job.start("policy", 0)
        rollout = [job.start("rollout", r) for r in range(2)]
        job.wait_for("rank 1 to commit 5 refits", lambda: _committed_at_least(job, rollout[1], 5))
        job.scale(1)
        codes = _finish(job, [policy, *rollout])
        assert codes == [0, 0, 0], job.logs()  # the removed rank exits 0 too
        left = _report(job, rollout[1])
        assert left is not None and left.state == "left", job.logs()  # type: ignore[attr-defined]
        assert left.refits_completed < LONG_RUN  # type: ignore[attr-defined]
        done = _report(job, rollout[0])
        assert done is not None
        assert (done.state, done.refits_completed) == ("done", LONG_RUN)  # type: ignore[attr-defined]
        assert _committed(rollout[0]) == list(range(LONG_RUN))
        # What rank 1 committed before it left is whole refits, in order.
        got = _committed(rollout[1])
        assert got == list(range(len(got))), got


def test_two_policy_ranks_follow_a_scale_down_that_changes_the_mapping(tmp_path: Path) -> None:
    # With 2 policy ranks, R = 3 gives each rollout rank one source and R = 1 gives rank 0
    # both (striped): a policy rank that planned a refit by the old mapping must still send
    # its share by the new one, or the other waits for it in vain (and the gang times out).
    with DemoJob(tmp_path, policy=2, rollout=3, refits=LONG_RUN) as job:
        policy = [job.start("policy", r) for r in range(2)]
        rollout = [job.start("rollout", r) for r in range(3)]
        job.wait_for("rank 2 to commit 5 refits", lambda: _committed_at_least(job, rollout[2], 5))
        job.scale(1)
        codes = _finish(job, [*policy, *rollout])
        assert codes == [0] * 5, job.logs()
        for pod in rollout[1:]:
            left = _report(job, pod)
            assert left is not None and left.state == "left", job.logs()  # type: ignore[attr-defined]
        assert _committed(rollout[0]) == list(range(LONG_RUN)), job.logs()
        for pod in policy:  # no refit waited out its timeout for a share that never came
            assert "reached no rollout member" not in pod.log.read_text(), job.logs()


def test_two_policy_ranks_follow_a_scale_up_that_changes_the_mapping(tmp_path: Path) -> None:
    with DemoJob(tmp_path, policy=2, rollout=1, refits=LONG_RUN) as job:
        policy = [job.start("policy", r) for r in range(2)]
        first = job.start("rollout", 0)
        job.wait_for("rank 0 to commit 5 refits", lambda: _committed_at_least(job, first, 5))
        job.scale(3)
        added = [job.start("rollout", r) for r in (1, 2)]
        codes = _finish(job, [*policy, first, *added])
        assert codes == [0] * 5, job.logs()
        assert _committed(first) == list(range(LONG_RUN)), job.logs()
        for pod in added:  # each joined at a refit boundary and got every refit after it
            got = _committed(pod)
            report = _report(job, pod)
            assert report is not None and report.seed is not None, job.logs()  # type: ignore[attr-defined]
            if report.seed.source != "policy":  # type: ignore[attr-defined]
                # Seeded from a peer with the version it served then (issue #31); the
                # refit already on its way to the others when it joined is not its.
                assert got[0] == report.seed.refit, (pod.rank, got, report.seed)  # type: ignore[attr-defined]
                got = got[1:]
            assert got and got == list(range(got[0], LONG_RUN)), (pod.rank, got)
        for pod in policy:
            assert "reached no rollout member" not in pod.log.read_text(), job.logs()


def test_a_stale_pod_goes_quietly_when_its_replacement_holds_the_rank(tmp_path: Path) -> None:
    with DemoJob(tmp_path, policy=1, rollout=2, refits=LONG_RUN) as job:
        policy = job.start("policy", 0)
        first = [job.start("rollout", r) for r in range(2)]
        job.wait_for("rank 1 to commit 5 refits", lambda: _committed_at_least(job, first[1], 5))
        # Its node stopped reporting: the operator replaces the pod without waiting for it
        # to go; the old process still runs and must not write over the new one's reports.
        resume = _report(job, first[1]).refits_completed  # type: ignore[union-attr]
        replacement = job.start("rollout", 1, generation=1, first_refit=resume)
        codes = _finish(job, [policy, first[0], replacement, first[1]])
        assert codes == [0, 0, 0, EXIT_PREEMPTED], job.logs()
        assert "stale pod" in first[1].log.read_text()
        report = _report(job, replacement)
        assert report is not None, job.progress()
        assert (report.state, report.refits_completed, report.generation) == ("done", LONG_RUN, 1)  # type: ignore[attr-defined]


# R at each change: every change of R with 2 policy ranks changes some member's sources
# (R = 1: rank 0 has both, striped; R = 2: one each; R = 3: rank 0 and 2 have policy 0).
SCALES = (1, 3, 2, 1, 2, 3, 1, 3, 2, 3, 1, 2, 1, 3, 2, 1, 3, 1, 2, 3)
#: The change after which rollout rank 1 is SIGKILLed and replaced (R = 3 there).
REPLACE_AT = 9
#: Refits of rank 0 between two changes, and the run's length: refits are ~30 ms here
#: and each change waits for the ranks it removed to leave (~1 s), so the policy is still
#: sending when the last change lands.
REMAP_EVERY = 8
REMAP_RUN = 900


def _left(job: DemoJob, pod: Pod) -> bool:
    report = _report(job, pod)
    return report is not None and report.state == "left"  # type: ignore[attr-defined]


def _holds(job: DemoJob, rank: int) -> bool:
    """Whether ``rank`` has a pod that still runs or finished the job: not one that left,
    even while its process is still exiting (the membership no longer lists it)."""
    pod = job.pods.get(("rollout", rank))
    if pod is None or _left(job, pod):
        return False
    return pod.proc.poll() is None or _done(job, pod)


def _scale_to(job: DemoJob, replicas: int, generations: dict[int, int]) -> list[Pod]:
    """``kubectl scale`` to ``replicas``, as the operator follows it: ranks past it leave
    at a refit boundary on their own (waited for), and each rank in it whose pod is gone
    gets a pod of the rank's next generation, resuming where the policy is (not waited
    for: a pod still starting when its rank is removed again leaves)."""
    # Each change is seen before the next: the barrier lists R, and every member it
    # removed left (or is gone), so no change lands unseen between two of a member's
    # barrier reads (that case, a rank removed and relisted before it noticed, has its own
    # test in test_nixl_membership.py).  A pod still starting is not waited for: it leaves
    # once it starts and finds its rank past R.
    before = job.store.barrier()
    removed = [
        p
        for (role, rank), p in list(job.pods.items())
        if role == "rollout"
        and rank >= replicas
        and before is not None
        and before.is_member("rollout", rank, p.uid, p.generation)
    ]
    job.scale(replicas)
    job.wait_for(
        f"the membership to follow the scale to {replicas}",
        lambda: (b := job.store.barrier()) is not None and b.rollout_world_size == replicas,
    )
    job.wait_for(
        f"the rollout ranks past {replicas - 1} to leave",
        lambda: all(_left(job, p) or p.proc.poll() is not None for p in removed),
    )
    progress = job.progress()
    resume = min(progress[("policy", r)].refits_completed for r in range(2))  # type: ignore[attr-defined]
    added = []
    for rank in range(replicas):
        if not _holds(job, rank):
            generations[rank] = generations.get(rank, -1) + 1
            added.append(
                job.start("rollout", rank, generation=generations[rank], first_refit=resume)
            )
    return added


def _listed(job: DemoJob, pod: Pod) -> bool:
    barrier = job.store.barrier()
    return barrier is not None and barrier.is_member("rollout", pod.rank, pod.uid, pod.generation)


def _relisted(job: DemoJob, pod: Pod) -> bool:
    """Whether the barriers listed ``pod``, then not, then again (removed and relisted
    before it noticed: it misses the refits sent meanwhile, by design)."""
    seen = [b.is_member("rollout", pod.rank, pod.uid, pod.generation) for b in job.barriers]
    first = seen.index(True) if True in seen else len(seen)
    rest = seen[first:]
    return False in rest and True in rest[rest.index(False) :]


def _replace(job: DemoJob, rank: int, generations: dict[int, int]) -> tuple[Pod, list[Pod]]:
    """SIGKILL ``rank``'s pod once it is a member and committed a refit, and start its
    replacement as the operator would; the killed pod and the pods started."""
    pod = job.pods[("rollout", rank)]
    job.wait_for(
        f"rollout rank {rank} to be a member with a refit committed before its kill",
        lambda: _listed(job, pod) and bool(_committed(pod)),
    )
    job.kill(pod)
    return pod, _scale_to(job, job.desired, generations)


def _settle(job: DemoJob, replicas: int, generations: dict[int, int]) -> list[Pod]:
    """After the last scale: every rank of it gets a member or is done (a pod that left
    after an earlier removal is replaced), so the lingering policy has someone to finish
    with and no slot waits for a pod that already left."""
    added: list[Pod] = []
    while True:
        added += _scale_to(job, replicas, generations)
        current = [job.pods[("rollout", rank)] for rank in range(replicas)]
        job.wait_for(
            f"rollout ranks 0..{replicas - 1} to be members or gone",
            lambda current=current: all(  # type: ignore[misc]
                _listed(job, p) or p.proc.poll() is not None for p in current
            ),
        )
        # A pod that finished (done: it had the last refit) needs no member after it.
        if all(_listed(job, p) or _done(job, p) for p in current):
            return added


def test_two_policy_ranks_send_each_refit_by_one_plan_while_r_keeps_changing(
    tmp_path: Path,
) -> None:
    # Each change lands at no particular point of a refit: with each
    # rank reading the membership on its own, one of them sooner or later planned a refit
    # by the old R while the other's receivers waited for its share, and the gang met its
    # group's timeout.  By one plan, no refit waits for a share and none restarts.
    # Halfway, a member is SIGKILLed and replaced: the others go on by the same plan.
    with DemoJob(tmp_path, policy=2, rollout=3, refits=REMAP_RUN) as job:
        policy = [job.start("policy", r) for r in range(2)]
        pods = [job.start("rollout", r) for r in range(3)]
        first, generations = pods[0], {0: 0, 1: 0, 2: 0}
        killed = None
        for step, replicas in enumerate(SCALES):
            # At no particular point of a refit, REMAP_EVERY refits after the last change.
            report = _report(job, first)
            mark = (report.refits_completed if report else 0) + REMAP_EVERY  # type: ignore[attr-defined]
            job.wait_for(
                f"rollout rank 0 to commit {mark} refits before the scale to {replicas}",
                lambda mark=mark: _committed_at_least(job, first, mark),  # type: ignore[misc]
            )
            pods += _scale_to(job, replicas, generations)
            if step == REPLACE_AT:
                killed, added = _replace(job, 1, generations)
                pods = [p for p in pods if p is not killed] + added
        pods += _settle(job, SCALES[-1], generations)
        # No policy restart; every rollout pod left at a refit boundary or finished.
        assert set(_finish(job, [*policy, *pods])) == {0}, job.logs()
        assert killed is not None and killed.proc.returncode == -9
        assert any(p.rank == 1 and p.generation > killed.generation for p in pods), pods
        assert [p for p in job.gone if p.role == "policy"] == [] and job.epoch == 0
        final = [job.pods[("rollout", rank)] for rank in range(SCALES[-1])]
        assert all(_done(job, p) for p in final), job.logs()
        # Rank 0 is a member throughout: every refit, in order, each bit-exact.
        assert committed_refits(first.log.read_text()) == list(range(REMAP_RUN)), job.logs()
        assert _report(job, first).verification == "bit-exact"  # type: ignore[union-attr]
        for pod in pods[1:]:  # each joined at a refit boundary, then missed none as a member
            # (a first commit seeded by a peer, issue #31, may precede the refit in flight)
            got = sent_refits(pod.log.read_text())
            if not _relisted(job, pod):
                assert not got or got == list(range(got[0], got[0] + len(got))), (pod, got)
            assert got == sorted(set(got)), (pod, got)
        sizes = [b.rollout_world_size for b in job.barriers]
        changes = sum(1 for a, b in pairwise(sizes) if a != b)
        assert changes >= len(SCALES), sizes
        for pod in policy:
            text = pod.log.read_text()
            assert "reached no rollout member" not in text and "reached no member" not in text
