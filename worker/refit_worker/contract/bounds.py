"""The bounds of a RefitJob's counts, times and bucket size: what the API refuses.

Each bound is far beyond any real job and well inside what the code can hold.  Without
them, ``transfer.timeoutSeconds: 1e308`` overflowed a ``timedelta`` in every policy rank
(retried until ``maxRestarts`` ran out), ``weights.synthetic.layers: 1000000000000`` hung
the generator, ``bucketSize: 1Ti`` had every rank fail to allocate its buffers and
``bucketSize: 1`` failed only once the first refit was planned.  The spec's models (and so
the generated CRD) and the worker's config take them from here, so a value the API stores
is one the worker accepts.
"""

from __future__ import annotations

from refit_worker.contract.dtypes import ITEMSIZE

DAY = 86400
WEEK = 7 * DAY
YEAR = 365 * DAY

#: The smallest bucket: one element of the widest dtype the wire carries (8 bytes); the
#: planner cuts a tensor into whole elements, so a smaller one cannot carry it.
MIN_BUCKET_BYTES = max(ITEMSIZE.values())
#: The largest bucket, 64 GiB: every rank allocates two of them in full when it starts
#: (``NIXL_TRANSFER_BUFFER_COUNT``), whatever the model's size.
MAX_BUCKET_BYTES = 64 << 30

#: ``transfer.timeoutSeconds``: one wait for a peer, a refit's transfer, a staged landing.
MAX_WAIT_SECONDS = DAY
#: The failure policies' backoffs (``backoffSeconds``, ``maxBackoffSeconds``).
MAX_BACKOFF_SECONDS = DAY
#: How long a node may be lost (``nodeLostSeconds``).
MAX_NODE_LOST_SECONDS = DAY
#: How long a gang may take to start (``startDeadlineSeconds``, a PodGroup's
#: ``scheduleTimeoutSeconds``).
MAX_START_SECONDS = WEEK
#: A job's whole life and how long it stays after (``activeDeadlineSeconds``,
#: ``ttlSecondsAfterFinished``).
MAX_LIFE_SECONDS = YEAR

#: The synthetic model's sizes: beyond the largest real models (126 layers, hidden 16384,
#: vocabularies of 256k, 256 experts), and small enough to list its tensors quickly.
MAX_LAYERS = 4096
MAX_HIDDEN = 65536
MAX_VOCAB = 1 << 20
MAX_EXPERTS = 1024
#: Refits of one job: a refit a minute for almost two years.
MAX_REFITS = 1_000_000
#: Restarts of the policy gang, replacements of rollout replicas.
MAX_RESTARTS = 10_000
