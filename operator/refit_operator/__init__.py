"""kube-refit operator: reconciles ``RefitJob`` resources into policy and rollout pods.

Folders by layer, each importing only those below it (import-linter, ``pyproject.toml``):

- ``cli``: the ``refit`` command (``run``, ``operator``, ``crd``);
- ``shell/``: the operator on a cluster (kopf handlers, controller, API writes) and
  ``local/``: ``refit run`` on one machine, the two shells, neither importing the other;
- ``apply/``: the one applier both shells turn a decision into writes with;
- ``core/``: the pure decisions (the reconcile and its policy steps);
- ``render/``: pure rendering of a job's children;
- ``api/``: the ``RefitJob`` models, their CRD, names and labels.

Of the worker it imports ``refit_worker.contract`` (the operator-worker contract), and the
local runner the worker's file-backed rendezvous store in place of ConfigMaps.
"""

__version__ = "0.1.0"
