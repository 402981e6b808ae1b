"""The ``RefitJob`` API: the pydantic models of spec and status (the one source of the
schema), the pieces they are built of (names, quantities, roles, the upstream pod template,
the wire base), and the CRD generated from them.

The bottom layer: imports nothing else of the operator (``pyproject.toml``'s contracts).
"""
