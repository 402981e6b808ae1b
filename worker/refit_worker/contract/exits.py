"""The worker's exit codes: how a pod's end tells the operator what happened.

The operator (``observe.py``) and the local runner count :data:`EXIT_PREEMPTED` as a
preemption, not a failure; the rest are what ``refit-worker --help`` lists.
"""

from __future__ import annotations

#: Every refit done.
EXIT_DONE = 0
#: A real failure: uses up one of the job's ``maxRestarts``.
EXIT_FAILED = 1
#: The ``REFIT_*`` environment is missing or invalid; nothing was joined or started.
EXIT_BAD_CONFIG = 2
#: Stopped at a safe point because of a preemption signal or the job's preemption notice.
EXIT_PREEMPTED = 83
#: A failure no restart can cure (an unsupported dtype, a missing checkpoint file, an
#: unknown backend): the operator fails the job at once instead of retrying with backoff.
EXIT_NOT_RETRYABLE = 84

#: Exit codes that fail the job at once: a restart would meet the same input again.
NOT_RETRYABLE = frozenset({EXIT_BAD_CONFIG, EXIT_NOT_RETRYABLE})
