"""A rollout rank's part of the engine: admission, landing and checks of a refit, peer seeding."""
