"""What both roles' sessions share: the base class (``base``), one rank's connection to its
job (``connection``), following the membership (``following``), what a refit hands back
(``refits``), progress reports (``reporting``) and the job's key halves (``job_keys``).
The session API itself is the package face: ``from refit_worker import RefitSession``."""
