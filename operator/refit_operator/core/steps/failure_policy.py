"""What a failed or disrupted pod of the epoch does to the job.

- A pod whose container exited with a code of ``refit_worker.contract.exits.NOT_RETRYABLE``
  (a bad configuration, or a failure the worker knows no restart can cure) fails the job
  at once: reason ``NotRetryable``, the pod's termination message in ``status.message``,
  no restart and no backoff.
- Any other failure of a policy pod restarts the policy gang (``maxRestarts``, doubling
  backoff); a disruption (drain, eviction, deletion, a preempted exit, a missing pod, a
  lost node) restarts it as a preemption, counted apart, and so does a failure beside
  a disruption (:func:`counted`: a drain is never a failure).  The rollout replicas keep
  running (their own failures are ``rollout_replicas.py``'s).
- A preemption only the worker claims (its exit code, its rank's report), with nothing
  attesting it, is no preemption (``core/claims.py``): a Warning Event names the pod.
"""

from __future__ import annotations

from refit_operator.core.draft import Draft
from refit_operator.core.phases import Outcome
from refit_operator.core.round_input import RoundInput
from refit_operator.core.steps.restart import restart_gang, stop_gang
from refit_worker.contract.exits import NOT_RETRYABLE


def announce_ignored_claims(inp: RoundInput, draft: Draft) -> None:
    """A preemption no one attested is said in a Warning Event naming the pod; the round
    already reads its pod as what it is (``claims.py``)."""
    draft.actions.extend(inp.ignored_claims)


def fail_not_retryable(inp: RoundInput, draft: Draft) -> Outcome | None:
    pod = next(
        (p for p in inp.current if p.failure and p.exit_code in NOT_RETRYABLE),
        None,
    )
    if pod is None:
        return None
    stop_gang(inp, draft)
    message = f"{pod.failure}; exit code {pod.exit_code} is not retryable: no restart"
    draft.fail("NotRetryable", message)
    return Outcome.NOT_RETRYABLE


def restart_on_failure(inp: RoundInput, draft: Draft) -> Outcome | None:
    failures, disruptions = counted(inp)
    if not failures and not disruptions:
        return None
    return restart_gang(
        inp,
        draft,
        failures=failures,
        disruptions=disruptions,
        notice_from=inp.first_disrupted,
        scope="policy",
    )


def counted(inp: RoundInput) -> tuple[list[str], list[str]]:
    """The failures and the disruptions the policy gang's stop is counted by.

    Beside a disruption of the gang (a rank drained, evicted, deleted, lost or gone), a
    rank's own failure is the disruption's: its collective broke when the taken rank
    stopped, and on a loaded node that is before the preemption notice reaches it (the
    worker waits for the notice only a few seconds).  So the stop is a preemption and
    uses up no ``maxRestarts``; a real failure beside it would fail the next epoch again.
    A gang that fell short is no one's knock-on: it counts as it is.
    """
    failures, disruptions = inp.failures, inp.disruptions
    if not disruptions or inp.short is not None:
        return failures, disruptions
    return [], [*disruptions, *failures]
