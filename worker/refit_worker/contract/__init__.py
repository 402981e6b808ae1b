"""The operator↔worker contract: everything both sides must agree on, and nothing else.

Start reading here.  The operator imports only this package of the worker (import-linter
checks it, see ``pyproject.toml``); the worker's own modules build on it.

- :mod:`.config` — ``WorkerConfig``: the one channel from operator to worker, rendered into
  a pod's ``REFIT_*`` environment (``to_env``) and read back (``from_env``); the transfer
  knobs both sides share (``TransferKnobs``) and the weights sources.
- :mod:`.signals` — the signal vocabulary: the one parser of signal names and numbers, the
  uncatchable set, signal lists, and the CRD's pattern, all from one table.
- :mod:`.env` — env names that stdlib-only tools read (``refit-signal``), and
  ``Preemption.from_env`` for a user's own training loop.
- :mod:`.exits` — the worker's exit codes (83: preempted).
- :mod:`.failures` — failures no restart can cure, as types, and the exit code of each
  (84: not retryable, the job fails at once).
- :mod:`.roles` — ``Role`` / ``ROLES``.
- :mod:`.dtypes` — the dtype names the wire carries and synthetic weights use, and their
  widths (no torch).
- :mod:`.bounds` — the largest counts and times a job may ask for, and the bucket size's
  range: what the API refuses and the worker's config too.
- :mod:`.entries`, :mod:`.rendezvous` — the rendezvous protocol: keys, typed entries and
  the coordinator's decisions (barrier, progress, preemption notice), pure.

This ``__init__`` imports nothing, so ``signals``, ``env``, ``exits``, ``failures``,
``roles`` and ``dtypes`` load with the standard library alone (``refit-signal`` runs as a
preStop hook).
"""
