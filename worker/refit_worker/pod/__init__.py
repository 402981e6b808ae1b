"""The pod program's parts (``refit-worker``, :mod:`refit_worker.__main__`): where a policy
rank's weights come from (``weights``), the rank's ``/metrics`` (``metrics``) and the
failing worker's last word in its termination message (``termination``)."""
