"""The one backoff of the operator: how long to wait before the next try of something
that failed ``attempt`` times, doubling from a first delay up to a cap.

Three things wait by it: the policy gang's restart after a failure
(``spec.failurePolicy``: ``backoffSeconds``, ``maxBackoffSeconds``, counted by the
restarts), a rollout replica's replacement after a failure (``rollout.failurePolicy``,
counted by that rank's failures in a row), and the controller's next try of a round the
apiserver refused.

Pure.
"""

from __future__ import annotations


def doubling(first: float, cap: float, attempt: int) -> float:
    """The wait before the try after failure number ``attempt`` (1 the first): ``first``,
    doubled for each failure after the first, never over ``cap``.

    ``attempt`` 0 or less waits ``first`` too (capped).  A count so large that the
    doubling leaves the float range waits ``cap``: it is over any cap there is.
    """
    if first <= 0 or attempt <= 1:
        return float(min(cap, first))
    try:
        return float(min(cap, first * 2 ** (attempt - 1)))
    except OverflowError:  # past ~2**1023: over the cap by far
        return float(cap)
