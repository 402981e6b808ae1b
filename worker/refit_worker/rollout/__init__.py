"""The rollout rank's side of refits: :class:`~refit_worker.rollout.rollout_session.RolloutSession`
(receives, verifies and commits each refit), where a refit lands (``targets``), the delta
base it applies to (``delta_base``), and peer seeding: the offer and the take
(``peer_seeds``) and which peer to seed from (``seed_choice``)."""
