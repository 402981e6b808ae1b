"""The operator's pure core: everything that decides, nothing that does.

``reconcile.reconcile(job, observed, now, options) -> Decision`` reads the job and what
was observed of its children (``observe.py``) and returns the actions and the next
status (``decision.py``), in named stages (``stages.py``) of policy steps (``steps/``);
the shells (``refit_operator.shell.controller`` against the API,
``refit_operator.local.runner`` for ``refit run``) turn the actions into writes through one
applier (``refit_operator.apply.applier``).  The core calls the renderers (``render/``) for
the objects its actions create.
"""
