"""The reconcile's policy steps, one module per decision (see ``core/reconcile.py`` for
their order).  Each step is ``step(round_input, draft) -> Finding | None``: it reads what
was observed from the frozen input and the status so far from the draft, adds actions and
status changes to the draft, and returns a finding when it ends the round's decision.

Must not import: kopf, kubernetes, aiohttp.
"""
