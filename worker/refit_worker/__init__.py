"""kube-refit worker library: what runs inside policy and rollout pods.

Public pieces live in submodules (``signal_handler``, ``checkpoint_engines``,
``rendezvous``, ``config``); importing this package imports none of the heavy ones
(torch, nixl, kubernetes), so the preStop delivery command stays dependency-free.

Must not import: ``refit_operator``.
"""

__version__ = "0.1.0"
