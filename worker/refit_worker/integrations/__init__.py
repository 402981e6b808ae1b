"""Integrations of the worker library with inference engines.

- :mod:`.staged`: a :class:`~refit_worker.RolloutSession` on a background thread that
  receives each refit into its own registered staging memory, verifies it, and hands it to
  the engine to land between generation steps (engine-agnostic, no engine import).
- :mod:`.vllm`: the vLLM worker extension and weight-transfer backend built on it (vLLM
  imported lazily, only by the code paths that run inside a vLLM worker).
"""
