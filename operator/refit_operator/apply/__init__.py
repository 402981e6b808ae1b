"""The one applier both shells use: a round's decision turned into writes through the
shell's own :class:`~refit_operator.apply.applier.Writes` (the API for the controller,
processes and files for ``refit run``), in an order that keeps a lost status write
harmless; and what a writer fills in as it creates (``fresh_key``: the signing key pair).

Above the pure core, below both shells: it orders and calls writes, and makes none itself.
"""
