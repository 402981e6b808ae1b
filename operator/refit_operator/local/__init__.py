"""Running a RefitJob without a cluster: a process kubelet and the ``refit run`` loop.

Reuses the operator's pure rendering and reconcile; only the doing differs (local processes
and a file-backed rendezvous store instead of API calls).
"""
