"""Pure rendering: the typed spec turned into the manifests of a RefitJob's children.

``pods`` renders each rank's pod (worker config and env, the spec hash, the preemption
signal, the merge into the role's template by ``merge``) and the gang of an epoch, with
its admission (``gang``: scheduling gates or a PodGroup); ``children`` the objects that
live as long as the job (Services, rendezvous ConfigMaps, RBAC, the signing key's Secret
from ``signing_key``).  Every renderer maps the spec to plain dicts; nothing here reads or
writes the API, and nothing here decides (the core calls these renderers).
"""
