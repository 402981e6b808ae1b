"""The reconcile's policy steps, one module per decision (see ``core/stages.py`` for the
stages they run in and their order).  A step reads what was observed from the frozen
input and the status so far from the draft, and adds actions and status changes to the
draft.  A policy, ``step(round_input, draft) -> Outcome | None``, returns an
:class:`~refit_operator.core.phases.Outcome` when it ends the round's decision; a step
that always runs, ``step(round_input, draft) -> None``, never ends it.
"""
