"""``refit run``'s failure-domain flags: kill one rollout or policy pod, or scale the
rollout replicas, once the first rollout rank has committed refit N.

What is here: the flags, their parsing and checking against the job (a bad value is a
usage error, nothing starts), and the pure decision of which faults are due.  The runner
does them (``runner.py``): a kill is a real SIGKILL of the pod's process group, a scale
is the change ``kubectl scale`` makes to the spec (``spec.rollout.replicas`` and the
job's ``metadata.generation``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from refit_operator.api.models import RefitJobSpec
from refit_worker.contract.rendezvous import (
    MAX_RANKS,
    EntryError,
    ProgressEntry,
    decode_entry,
    parse_key,
)

FaultKind = Literal["kill-rollout", "kill-policy", "scale-rollout"]


@dataclass(frozen=True)
class Fault:
    """One thing to do to the running job once ``at_refit`` refits are committed."""

    kind: FaultKind
    at_refit: int
    #: The rollout replica count a scale sets (0 for a kill).
    replicas: int = 0

    @property
    def flag(self) -> str:
        return f"--{self.kind}-at-refit"

    @property
    def untouched_role(self) -> str:
        """The role this fault must leave running: the policy, unless a policy pod is
        killed (then the rollout)."""
        return "rollout" if self.kind == "kill-policy" else "policy"


def add_arguments(run: Any) -> None:
    """The flags that show the failure domains without a cluster."""
    run.add_argument(
        "--kill-rollout-at-refit",
        type=refit_number,
        metavar="N",
        help="SIGKILL rollout rank 0's pod once the first rollout rank has committed N "
        "refits (1 <= N < spec.transfer.refits): that replica alone is replaced, the "
        "policy pods keep running, and the replacement is seeded with the last committed "
        "refit by the live rollout replicas (the policy's next send when none offers it); "
        "a ReplicaSeeded line says who seeded it and how long it took",
    )
    run.add_argument(
        "--kill-policy-at-refit",
        type=refit_number,
        metavar="N",
        help="SIGKILL policy rank 0's pod once N refits are committed: the policy gang is "
        "restarted in a new epoch, the rollout pods keep running and rejoin it",
    )
    run.add_argument(
        "--scale-rollout-at-refit",
        type=scale_target,
        metavar="N:R",
        help="once N refits are committed, set spec.rollout.replicas to R, as kubectl "
        "scale would: new replicas are seeded by the serving ones and then join at the "
        "next refit, removed ones leave at a refit boundary, the policy pods are "
        "untouched",
    )


def refit_number(text: str) -> int:
    """An argparse type: a whole number of refits >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a whole number of refits >= 1")
    return int(text)


def scale_target(text: str) -> tuple[int, int]:
    """An argparse type: ``N:R``, refit N >= 1 and R >= 1 rollout replicas."""
    refit, sep, replicas = text.partition(":")
    if not sep or not refit.isdigit() or not replicas.isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected N:R, the refit to scale at and the rollout replica count "
            "to set, e.g. 1:3"
        )
    if int(refit) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the refit N must be >= 1")
    if int(replicas) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: R must be >= 1: a job needs a rollout replica to refit into"
        )
    return int(refit), int(replicas)


def planned(args: argparse.Namespace) -> tuple[Fault, ...]:
    """The faults the flags ask for, in the order they fire."""
    out: list[Fault] = []
    if args.kill_rollout_at_refit is not None:
        out.append(Fault("kill-rollout", args.kill_rollout_at_refit))
    if args.kill_policy_at_refit is not None:
        out.append(Fault("kill-policy", args.kill_policy_at_refit))
    if args.scale_rollout_at_refit is not None:
        refit, replicas = args.scale_rollout_at_refit
        out.append(Fault("scale-rollout", refit, replicas))
    return tuple(sorted(out, key=lambda f: f.at_refit))


def problem(faults: tuple[Fault, ...], spec: RefitJobSpec, *, drains: bool) -> str | None:
    """What is wrong with the faults for this job, or None."""
    refits = spec.transfer.refits
    for fault in faults:
        if fault.at_refit >= refits:
            return (
                f"{fault.flag} {fault.at_refit}: the job does {refits} refit(s), so no refit "
                f"would be left after it; use 1 to {refits - 1}"
                if refits > 1
                else f"{fault.flag}: the job does 1 refit, so nothing is left after one; "
                "raise spec.transfer.refits"
            )
        if fault.kind == "scale-rollout":
            if fault.replicas == spec.rollout.replicas:
                return (
                    f"{fault.flag} {fault.at_refit}:{fault.replicas}: the job already has "
                    f"{fault.replicas} rollout replica(s); give another count"
                )
            if spec.policy.replicas + fault.replicas > MAX_RANKS:
                return (
                    f"{fault.flag} {fault.at_refit}:{fault.replicas}: {spec.policy.replicas} "
                    f"policy + {fault.replicas} rollout ranks is over the {MAX_RANKS} a "
                    "rendezvous holds"
                )
    if faults and drains:
        return (
            "--drain-after/--drain-at-refit and the --kill-*/--scale-* flags each disturb "
            "the job: give one of them per run, so its output shows what that one did"
        )
    return None


def due(faults: tuple[Fault, ...], done: frozenset[Fault], committed: int) -> list[Fault]:
    """The faults not done yet whose refit the first rollout rank has committed."""
    return [f for f in faults if f not in done and committed >= f.at_refit]


def most_rollout_replicas(faults: tuple[Fault, ...], spec: RefitJobSpec) -> int:
    """The most rollout replicas the run will have (ports and shards are planned for it)."""
    return max([spec.rollout.replicas, *(f.replicas for f in faults)])


def line(fault: Fault, target: str) -> str:
    """The live view's line when a fault fires (``target``: the pod, or the job)."""
    if fault.kind == "scale-rollout":
        return (
            f"scaling {target}: spec.rollout.replicas -> {fault.replicas} at refit "
            f"{fault.at_refit} (as kubectl scale rj/{target} --replicas={fault.replicas})"
        )
    role = fault.kind.removeprefix("kill-")
    return f"SIGKILL {role} pod {target} at refit {fault.at_refit} (its whole process group)"


@dataclass
class Fired:
    """A fault as it was done: when, to which pod, and what the run saw after it."""

    fault: Fault
    #: The pod killed (or the job, for a scale) and its uid ('' for a scale).
    target: str
    uid: str
    #: Seconds into the run (the runner's monotonic clock) when it was done.
    at: float
    #: Uids of the other role's pods running at that moment (a kill's "untouched" set).
    others: frozenset[str] = frozenset()
    #: The most refits a rollout rank had committed then.
    committed: int = 0
    #: Seconds from the kill to the first refit a new pod of the same rank committed.
    recovered_s: float | None = None
    #: Who sent that pod its first refit (``rollout-<rank>`` or ``policy``), as it said.
    seeded_from: str | None = None


def replacement_committed(
    entries: Mapping[tuple[str, int], ProgressEntry], role: str, rank: int, killed_uid: str
) -> bool:
    """Whether a pod other than the killed one now holds ``role`` rank ``rank`` and has
    committed a refit (its report itemises one, or says how it was seeded: a peer's
    seed is not itemised)."""
    entry = entries.get((role, rank))
    return (
        entry is not None
        and entry.uid != killed_uid
        and (bool(entry.recent) or entry.seed is not None)
    )


def replacement_seed(
    entries: Mapping[tuple[str, int], ProgressEntry], role: str, rank: int, killed_uid: str
) -> str | None:
    """Who sent the replacement of the killed pod its first refit, as it reported."""
    entry = entries.get((role, rank))
    if entry is None or entry.uid == killed_uid or entry.seed is None:
        return None
    return entry.seed.source


def latest_progress(data: Mapping[str, str]) -> dict[tuple[str, int], ProgressEntry]:
    """(role, rank) -> the progress entry of ``data`` with the most refits (any epoch)."""
    out: dict[tuple[str, int], ProgressEntry] = {}
    for key, value in data.items():
        parsed = parse_key(key)
        if parsed is None or parsed.kind != "progress":
            continue
        try:
            entry = decode_entry(key, value)
        except EntryError:
            continue
        if not isinstance(entry, ProgressEntry):
            continue
        slot = (entry.role, entry.rank)
        before = out.get(slot)
        if before is None or entry.refits_completed >= before.refits_completed:
            out[slot] = entry
    return out


def outcome(fired: Fired, new_after: frozenset[str]) -> str:
    """The summary's line for one fault: what the run saw after it (``new_after``: uids
    of the other role's pods first seen after it)."""
    fault = fired.fault
    other = fault.untouched_role
    if fault.kind == "scale-rollout":
        said = f"{fired.target} scaled to {fault.replicas} rollout replica(s) at refit "
        said += f"{fault.at_refit}; "
    else:
        said = f"{fired.target} SIGKILLed at refit {fault.at_refit}; "
        if fired.recovered_s is None:
            said += "no refit was committed after the kill before the run ended; "
        elif fault.kind == "kill-rollout":
            said += f"its replacement committed its first refit {fired.recovered_s:.1f} s "
            said += "after the kill"
            source = fired.seeded_from
            if source is not None:
                said += (
                    " (sent by the policy)" if source == "policy" else f" (seeded from {source})"
                )
            said += "; "
        else:
            said += f"the next refit was committed {fired.recovered_s:.1f} s after the kill; "
    if not new_after and fired.others:
        return f"  {said}the {other} pods ran on untouched (same {len(fired.others)} uid(s))"
    return (
        f"  {said}the {other} pods did not run on untouched: {len(new_after)} new {other} "
        f"pod(s) appeared after it"
    )
