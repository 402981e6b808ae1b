"""The policy rank's side of refits: :class:`~refit_worker.policy.policy_session.PolicySession`
(sends each refit to the rollout members of the moment), what each member is owed
(``owed``), the gang's one plan per refit (``gang_plan``), and the delta source with the
gang's agreement on a sharded delta (``delta_source``, ``delta_agreement``)."""
