"""The failure-domain section of ``docs/reliability.md`` (issue #20), printed as Markdown.

- Local runs (``refit run``'s runner, real processes, NIXL, signals): a rollout pod
  SIGKILLed (do the policy pods run on, how long until its replacement commits a refit),
  a policy pod SIGKILLed (do the rollout pods run on, how long until the next refit), the
  rollout replicas scaled up and down mid-job (do the policy pods run on).  ``--runs`` runs
  each; the seconds are medians, and every run's row is shown.
- The cluster tier's scenarios (``tests/cluster/test_failure_domains.py``: the same three
  plus a drain of a node holding only rollout pods, and a node that dies mid-refit): the
  tests' outcome and the figures they recorded.

Run: ``python bench/reliability_domains.py`` (``bench/reliability_report.py`` runs it and
puts its output in the doc).  Nothing here asserts performance; the times are this
machine's in this run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "operator", ROOT / "worker"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "operator"), str(ROOT / "worker")])

from tests.support.fault_runs import Topology, manifest  # noqa: E402

from refit_operator.api.models import parse_spec  # noqa: E402
from refit_operator.local.faults import Fault, outcome  # noqa: E402
from refit_operator.local.runner import RunOptions, RunResult, run_job  # noqa: E402

REFITS = 6
AT_REFIT = 2
TOPOLOGIES = (Topology(1, 2), Topology(2, 2))
CLUSTER_TESTS = "tests/cluster/test_failure_domains.py"


def _scenarios(topo: Topology) -> list[tuple[str, Fault]]:
    return [
        ("kill-rollout", Fault("kill-rollout", AT_REFIT)),
        ("kill-policy", Fault("kill-policy", AT_REFIT)),
        ("scale-up", Fault("scale-rollout", AT_REFIT, topo.rollout + 1)),
        ("scale-down", Fault("scale-rollout", AT_REFIT, topo.rollout - 1)),
    ]


def _run(topo: Topology, fault: Fault) -> RunResult:
    job = manifest("fd", topo, refits=REFITS, max_restarts=2, timeout=60)
    with tempfile.TemporaryDirectory(prefix="rel-fd-") as tmp:
        options = RunOptions(workdir=Path(tmp) / "work", timeout=600, faults=(fault,))
        return run_job(job, parse_spec(job["spec"]), options)


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f}" if values else "n/a"


def local(runs: int) -> list[str]:
    rows: list[str] = []
    seconds: dict[tuple[str, str], list[float]] = {}
    for topo in TOPOLOGIES:
        for name, fault in _scenarios(topo):
            if fault.kind == "scale-rollout" and fault.replicas < 1:
                continue
            for run in range(runs):
                result = _run(topo, fault)
                status = result.status
                said = "did not fire"
                if result.fired:
                    fired = result.fired[0]
                    other = "rollout" if fault.kind == "kill-policy" else "policy"
                    new = frozenset(
                        uid for uid, at in result.first_seen.get(other, {}).items() if at > fired.at
                    )
                    said = outcome(fired, new).strip()
                    if fired.recovered_s is not None:
                        seconds.setdefault((str(topo), name), []).append(fired.recovered_s)
                replaced = getattr(status.rollout, "replacements", "n/a")
                rows.append(
                    f"| {topo} | {name} | {run + 1} | {status.phase.value} | "
                    f"{status.refits_completed}/{REFITS} | {status.epoch} | {status.restarts} | "
                    f"{replaced} | {status.verification} | {said} |"
                )
    lines = [
        "## Failure domains: one pod killed, replicas scaled (local runs)",
        "",
        f"One job per row ({REFITS} refits of a ~9 MiB bf16 model in 64 KiB buckets; "
        f"timeoutSeconds 60, maxRestarts 2), run by `refit run`'s runner.  Once the first "
        f"rollout rank has committed {AT_REFIT} refits: *kill-rollout* SIGKILLs rollout rank "
        "0's process group, *kill-policy* policy rank 0's, *scale-up*/*scale-down* change "
        "`spec.rollout.replicas` by one as `kubectl scale` does.  The last column is the "
        "run's own summary line: whether the other role's pods ran on untouched (no new pod "
        "of that role was seen after the fault) and the seconds from the kill to the "
        "replacement's first committed refit (kill-rollout) or to the next committed refit "
        f"(kill-policy).  {runs} run(s) each.",
        "",
        "| topology | scenario | run | phase | refits | epoch | restarts | rollout "
        "replacements | verification | what followed |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "| topology | scenario | seconds to the first refit after the kill (median) |",
        "|---|---|---|",
        *(f"| {t} | {n} | {_median(v)} |" for (t, n), v in sorted(seconds.items())),
        "",
    ]
    return lines


def cluster() -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", CLUSTER_TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    out = done.stdout.splitlines()
    figures = [ln.removeprefix("cluster tier: ") for ln in out if "scenario:" in ln]
    outcomes = [ln for ln in out if ln.startswith(("PASSED", "FAILED", "ERROR"))]
    summary = [ln for ln in out if " passed" in ln or " failed" in ln or " error" in ln]
    return [
        "## Failure domains on the real control plane",
        "",
        f"`{CLUSTER_TESTS}` (two process nodes and, for the dead node, a third one that "
        "dies: its agent stops reporting and every process on it is SIGKILLed; the pods "
        "tolerate `unreachable`/`not-ready` for 5 s) in this run, exit "
        f"{done.returncode}:",
        "",
        "```",
        *outcomes,
        *summary[-1:],
        "```",
        "",
        "What the scenarios measured:",
        "",
        *(f"- {line}" for line in figures),
        *([] if figures else ["- nothing: no scenario got as far as its figures"]),
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="local runs per scenario")
    parser.add_argument(
        "--no-cluster", action="store_true", help="leave out the cluster tier's scenarios"
    )
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be >= 1 (got {args.runs})")
    lines = local(args.runs)
    lines += (
        ["## Failure domains on the real control plane", "", "Not run (--no-cluster).", ""]
        if args.no_cluster
        else cluster()
    )
    print("\n".join(lines).rstrip())


if __name__ == "__main__":
    main()
