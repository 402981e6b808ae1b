"""kube-refit operator: reconciles ``RefitJob`` resources into policy and rollout pods.

May import ``refit_worker.config`` (the operator-worker contract); nothing else of the worker.
"""

__version__ = "0.1.0"
