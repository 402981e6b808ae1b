"""kube-refit worker library: what runs inside policy and rollout pods.

Public pieces live in submodules (``signal_handler``, ``checkpoint_engines``,
``rendezvous``, ``session``); what the operator and the worker agree on is in ``contract``
(start reading there).  Importing this package imports none of the heavy ones (torch,
nixl, kubernetes), so the preStop delivery command stays dependency-free.

Must not import: ``refit_operator``.
"""

__version__ = "0.1.0"
