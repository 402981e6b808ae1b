"""kube-refit operator: reconciles ``RefitJob`` resources into policy and rollout pods.

May import ``refit_worker.contract`` (the operator-worker contract); nothing else of the
worker, except that the local runner (``local/runner.py``) uses the worker's file-backed
rendezvous store in place of ConfigMaps.  import-linter checks both (``pyproject.toml``).
"""

__version__ = "0.1.0"
