"""Writes ``docs/reliability.md``: the fault scenarios of ``tests/reliability`` run at report
size, and the figures they give.

- Drains at every stage of a refit x topologies (1,1), (2,2), (1,3), ``--runs`` times
  each, each a drain of the last rollout rank's pod: time until it stopped, until its
  replacement existed, until the replacement was a member (medians), where it really
  stopped, whether the job completed with every refit bit-exact, the policy untouched.
- SIGKILL of one seeded rank at a seeded moment, ``--kill-cases`` cases: the time until
  the replacement (a rollout pod, or the policy gang) existed, or the failure message once
  the role's budget is spent; processes left.
- API faults in the emulator (500s, 409s, 410 Gone watches, slow answers): the
  ConfigMap store's observed back-off, and the fault tests' outcome (operator included).
- Operator restart mid-job: the test's outcome.
- Bad input: the output of ``bench/reliability_badinput.py`` when that file exists.
- Failure domains (issue #20): the output of ``bench/reliability_domains.py``: a rollout
  or a policy pod SIGKILLed, the rollout replicas scaled, locally; and the cluster tier's
  scenarios (kill, drain of a rollout-only node, a dead node, scale) with their figures.

Run: ``python bench/reliability_report.py`` (``--quick``: one run per topology and 8
kills, for a smoke check; the committed doc is made without it).  Nothing here asserts
performance; times are what this machine measured in this run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "operator", ROOT / "worker"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "operator"), str(ROOT / "worker")])

from tests.support.fault_runs import (  # noqa: E402
    STAGES,
    TOPOLOGIES,
    KillPlan,
    Topology,
    committed_refits,
    manifest,
    preempted_reason,
    rollout_logs,
    run_with,
    seeded_kills,
    stage_plan,
    stop_point,
)
from tests.support.processes import processes_under  # noqa: E402

from refit_operator.api.models import Phase  # noqa: E402

#: Enough that the stages inside refits still have refits ahead when their drain goes in:
#: while a drained rank's replacement starts, the policy goes on refitting the others.
REFITS = 40
KILL_TOPOLOGIES = (Topology(1, 1), Topology(2, 2), Topology(1, 3), Topology(2, 1))


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f}" if values else "n/a"


def drains(runs: int) -> list[str]:
    rows: dict[tuple[str, str], dict[str, list[float]]] = {}
    points: dict[tuple[str, str], Counter[str]] = {}
    outcomes: list[str] = []
    for topo in TOPOLOGIES:
        for run in range(runs):
            with tempfile.TemporaryDirectory(prefix="rel-drain-") as tmp:
                workdir = Path(tmp) / "work"
                job = manifest("drain", topo, refits=REFITS, layers=12, bucket="16Ki")
                started = time.monotonic()
                result, observer, _ = run_with(
                    job,
                    stage_plan("drain", topo, REFITS),
                    workdir,
                    max_faults=len(STAGES),
                    timeout=600,
                )
                took = time.monotonic() - started
                committed: set[int] = set()
                exact = True
                for text in rollout_logs(workdir).values():
                    committed.update(committed_refits(text))
                    exact = exact and "VerificationError" not in text
                codes = Counter(observer.exit_codes.values())
                st = result.status
                outcomes.append(
                    f"| {topo} | {run + 1} | {st.phase.value} | "
                    f"{len(observer.faults)}/{len(STAGES)} | {st.rollout.replacements} | "
                    f"{st.epoch} / {st.restarts} | {sorted(committed) == list(range(REFITS))} "
                    f"and {'no' if exact else 'a'} failed check | "
                    f"{dict(sorted(codes.items()))} | {len(processes_under(workdir))} | "
                    f"{took:.0f} |"
                )
                for fault in observer.faults:
                    key = (str(topo), fault.stage)
                    row = rows.setdefault(key, {"stopped": [], "restarted": [], "ready": []})
                    for name, value in (
                        ("stopped", fault.stopped_s),
                        ("restarted", fault.restarted_s),
                        ("ready", fault.recovered_s),
                    ):
                        if value is not None:
                            row[name].append(value)
                    counter = points.setdefault(key, Counter())
                    for why in _stop_reports(workdir, fault.old_pods):
                        counter[why] += 1
            if result.status.phase != Phase.SUCCEEDED:
                print(
                    f"drain run {topo} #{run + 1} ended {result.status.phase}: "
                    f"{result.status.message}",
                    file=sys.stderr,
                )
    lines = [
        "## Drain at every stage of a refit",
        "",
        f"One job per topology and run ({REFITS} refits, a ~27 MiB bf16 model in 16 KiB "
        "buckets, grace 20 s) meets the five stages in turn, each a drain of the last "
        "rollout rank's pod of the time (DisruptionTarget, deletion, preStop, SIGTERM).  A "
        "rollout pod is its own failure domain: the drained pod alone is replaced, the "
        "policy pods run on (epoch 0, no restart), and the next drain meets the "
        f"replacement.  {runs} run(s) per topology; times are medians in seconds from the "
        "drain.",
        "",
        "| topology | run | phase | drains | rollout replacements | policy epoch / restarts "
        "| all refits committed, bit-exact | exit codes | processes left | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *outcomes,
        "",
        "| topology | stage | drained pod stopped (s) | replacement created (s) | "
        "replacement a member (s) | where the drained pod stopped (count) |",
        "|---|---|---|---|---|---|",
    ]
    for (shape, stage), row in rows.items():
        where = ", ".join(f"{k}: {v}" for k, v in sorted(points[(shape, stage)].items()))
        lines.append(
            f"| {shape} | {stage} | {_median(row['stopped'])} | "
            f"{_median(row['restarted'])} | {_median(row['ready'])} | {where} |"
        )
    lines += [
        "",
        "How each stage is reached: *during metadata exchange* (the job's first opening): "
        "policy rank 0 is held with SIGSTOP before it publishes, the drain goes in once "
        "every rollout rank published, then the held rank is let go (deterministic, "
        "checked); *before the barrier*: the replacement of that drain, running but not yet "
        "a member (checked); *mid-bucket*: 0.25 s after the rank's pod reports a commit of "
        "its own, with the policy gang held (SIGSTOP) until the drained pod exited, so the "
        "stop meets the rank waiting for the next refit's buckets; *between refits*: as "
        "soon as the rank's pod reports a commit; *during the final commit*: just after "
        "the second-to-last commit.  The last two are timed from outside, so where each "
        "drained pod really stopped is read from its own `preempted` report (the last "
        "column): at a bucket boundary it was inside a transfer; at a refit boundary, or "
        "waiting for the barrier (the coordinator took it out of the membership as soon "
        "as it was drained), it was between refits; a pod that finished its last refit "
        "first says it was done.",
        "",
    ]
    return lines


def _stop_reports(workdir: Path, pods: list[tuple[str, str]]) -> list[str]:
    out = []
    for name, uid in pods:
        log = workdir / "logs" / f"{name}-{uid[:8]}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        why = preempted_reason(text)
        if why is not None:
            out.append(stop_point(why, "preempted").value)
        elif "all " in text and "refits done" in text:
            out.append(stop_point("", "done").value)
        else:
            out.append("died of the stop signal during start-up (143, no report)")
    return out


def kills(cases: int) -> list[str]:
    per_job, timeout = 5, 30
    lines = [
        "## SIGKILL of one rank",
        "",
        f"{cases} kills: jobs of {per_job} kills each (backoff 0.5 s doubling to 2 s, "
        f"timeoutSeconds {timeout}, grace 10 s); round i gets a SIGKILL to a seeded rank's "
        "live pod at a seeded moment 0-3 s after the last kill's replacement was created "
        "or (half the cases, seeded) after it took part.  A killed rollout pod is replaced "
        "alone (maxReplacements), a killed policy pod restarts the policy gang "
        "(maxRestarts); each job's budgets let every kill but its last through.  Every "
        "kill but each job's last must have its replacement within timeoutSeconds + "
        f"maxBackoff ({timeout + 2} s); the last must fail the job naming the pod.",
        "",
        "| job | kill | target | at (s) | job then | outcome | pods stopped (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    restart_times: list[float] = []
    jobs = max(1, cases // per_job)
    left_total = 0
    for index in range(jobs):
        topo = KILL_TOPOLOGIES[index % len(KILL_TOPOLOGIES)]
        seed = 100 + index
        plan = seeded_kills(seed, per_job, topo, "kill", 3.0)
        roles = ["policy" if "-policy-" in k.pod else "rollout" for k in plan[:-1]]
        with tempfile.TemporaryDirectory(prefix="rel-kill-") as tmp:
            workdir = Path(tmp) / "work"
            job = manifest(
                "kill",
                topo,
                refits=1000,
                max_restarts=roles.count("policy"),
                max_replacements=roles.count("rollout"),
                backoff=0.5,
                timeout=timeout,
                grace=10,
            )
            result, observer, _ = run_with(
                job, KillPlan(plan), workdir, max_faults=per_job, timeout=300
            )
            left_total += len(processes_under(workdir))
        for i, fault in enumerate(observer.faults):
            last = i == len(observer.faults) - 1
            what = "policy gang recreated" if "-policy-" in fault.target else "pod replaced"
            if last:
                outcome = f"{result.status.phase.value}: {result.status.message}"
            elif fault.restarted_s is not None:
                outcome = f"{what} after {fault.restarted_s:.1f} s"
                restart_times.append(fault.restarted_s)
            else:
                outcome = "no replacement seen"
            stopped = f"{fault.stopped_s:.1f}" if fault.stopped_s is not None else "n/a"
            lines.append(
                f"| {topo} seed {seed} | {i + 1} | {fault.target} | "
                f"{plan[i].delay:.2f} after {plan[i].anchor} | {fault.stage} | "
                f"{outcome} | {stopped} |"
            )
    lines += [
        "",
        f"Replacement after a kill: median {_median(restart_times)} s, max "
        f"{max(restart_times, default=0):.1f} s over {len(restart_times)} restarts.  "
        f"Worker processes left after all jobs: {left_total}.",
        "",
    ]
    return lines


async def _store_backoff() -> list[float]:
    from tests.emulator import ApiEmulator, ApiFault

    from refit_worker.contract.rendezvous import Layout
    from refit_worker.rendezvous.configmap_store import ConfigMapStore
    from refit_worker.rendezvous.store import Member

    with tempfile.TemporaryDirectory() as tmp:
        async with ApiEmulator(Path(tmp)) as api:
            os.environ["KUBECONFIG"] = str(api.kubeconfig_path)
            store = ConfigMapStore("bo-rendezvous", "default", Layout(1, 1, 1))
            for name in store.names:  # the operator's map and each role's, as it makes them
                api.create("v1/configmaps", "default", {"metadata": {"name": name}, "data": {}})
            api.faults.add(ApiFault(code=500, method="PATCH", times=4))
            try:
                await asyncio.to_thread(
                    store.publish_metadata, Member("policy", 0, 0, "u"), json.dumps({"a": 1})
                )
            finally:
                store.close()
            at = [h.at for h in api.faults.hits]
            return [b - a for a, b in itertools.pairwise(at)]


def api_faults() -> list[str]:
    gaps = asyncio.run(_store_backoff())
    tests = [
        "tests/reliability/test_api_faults.py",
        "tests/cluster/test_lifecycle.py::test_operator_restart_mid_job_no_duplicates_no_lost_status",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0", *tests],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    summary = [
        ln for ln in done.stdout.splitlines() if " call " in ln or "passed" in ln or "failed" in ln
    ]
    return [
        "## API faults and operator restarts",
        "",
        "The ConfigMap store's retry of a write that met four 500s, as the emulator saw "
        "it: seconds between attempts "
        + ", ".join(f"{g:.2f}" for g in gaps)
        + " (doubling from 0.1 s, capped at 2 s; "
        "five attempts, then an error naming the ConfigMap and the status).",
        "",
        "The fault tests (`tests/reliability/test_api_faults.py`: the store's "
        "rendezvous under 409s, 500s, 410 Gone watches and 0.3 s answers; the operator "
        "under failed pod creates, status conflicts, 500s on patches and lists, expired "
        "watches and 0.2 s answers, checked to create each child once; "
        "`tests/cluster/test_lifecycle.py`: the operator process stopped with SIGTERM "
        "and started again twice mid-job, on the real control plane) in this run:",
        "",
        "```",
        *summary,
        "```",
        "",
    ]


def badinput() -> list[str]:
    script = ROOT / "bench" / "reliability_badinput.py"
    if not script.exists():
        return ["## Bad input", "", "`bench/reliability_badinput.py` is not there yet.", ""]
    done = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        return [
            "## Bad input",
            "",
            f"`bench/reliability_badinput.py` failed (exit {done.returncode}):",
            "",
            "```",
            done.stderr[-2000:],
            "```",
            "",
        ]
    return [done.stdout.rstrip(), ""]


def failure_domains(runs: int, *, with_cluster: bool) -> list[str]:
    """``bench/reliability_domains.py``'s section (issue #20), or why it is missing."""
    script = ROOT / "bench" / "reliability_domains.py"
    argv = [sys.executable, str(script), "--runs", str(runs)]
    done = subprocess.run(
        argv + ([] if with_cluster else ["--no-cluster"]),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return [
            "## Failure domains",
            "",
            f"`bench/reliability_domains.py` failed (exit {done.returncode}):",
            "",
            "```",
            done.stderr[-2000:],
            "```",
            "",
        ]
    return [done.stdout.rstrip(), ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="drain runs per topology")
    parser.add_argument("--kill-cases", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--no-cluster",
        action="store_true",
        help="leave out the failure-domain scenarios of the cluster tier (they need its "
        "control plane, tests/cluster/build.sh)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "reliability.md")
    args = parser.parse_args()
    runs, cases = (1, 10) if args.quick else (args.runs, args.kill_cases)
    if runs < 1 or cases < 5:
        parser.error(f"--runs must be >= 1 and --kill-cases >= 5 (got {runs}, {cases})")
    started = time.monotonic()
    body = drains(runs) + kills(cases) + api_faults() + badinput()
    body += failure_domains(runs, with_cluster=not args.no_cluster)
    head = [
        "# Reliability: figures under faults",
        "",
        "Generated by `python bench/reliability_report.py` "
        f"({'--quick, ' if args.quick else ''}{runs} drain run(s) per topology, "
        f"{cases} kills) in {time.monotonic() - started:.0f} s on "
        f"{os.cpu_count()} CPU cores; do not edit by hand.  The same scenarios run in CI "
        "as `tests/reliability/`, sampled (drains: topology (2,2); SIGKILL: 2 jobs of 5 "
        "kills, (2,2) and (1,3)); `REFIT_FULL_MATRIX=1 python -m pytest tests/reliability` "
        "runs every topology and kill job there too.",
        "",
    ]
    args.out.write_text("\n".join(head + body).rstrip() + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
