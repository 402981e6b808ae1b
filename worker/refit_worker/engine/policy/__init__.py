"""A policy rank's part of the engine: its connection's side, one refit's writes, its sources."""
