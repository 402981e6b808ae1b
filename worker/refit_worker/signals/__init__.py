"""Preemption signals: the gang-wide :class:`~refit_worker.signals.handler.DistributedSignalHandler`
(upstream's API), the preStop delivery command ``refit-signal`` (``delivery``) and the pid
registry through which processes say which signal they want (``pid_registry``).  Nothing
here imports torch eagerly, nixl or kubernetes: ``refit-signal`` runs as a preStop hook."""
