"""The worker extension: kube-refit's ``refit_*`` methods on every vLLM worker.

Mixed into vLLM's worker class by ``LLM(..., worker_extension_cls=WORKER_EXTENSION)``
(``self`` is then the worker); the driver calls the methods through
``llm.collective_rpc`` (:class:`~refit_worker.integrations.vllm.driver.VllmRefit`).  Every
argument and result is plain data (ints, floats, strings, lists), so it crosses vLLM's
multiprocess RPC unchanged.  One session per worker: with tensor parallelism each worker
is a rollout rank of its own (the environment's rank plus its tensor-parallel rank) and
receives only its part of each tensor (:mod:`.worker_part`).

What of vLLM this touches: ``Worker.reload_weights(weights_iterator=...)``,
``Worker.model_runner.get_model()``, ``Worker.vllm_config``.  No private attribute.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.entries import Verification
from refit_worker.integrations.staged import CommittedFigures
from refit_worker.integrations.vllm.adapter_landing import AdapterLanding, open_adapter_landing
from refit_worker.integrations.vllm.landing import RefitLanding
from refit_worker.integrations.vllm.worker_part import open_landing


def figures_plain(figures: CommittedFigures) -> dict[str, Any]:
    """A committed refit's figures as plain data."""
    version = figures.version
    return {
        "refit_id": figures.stats.refit_id,
        "bytes": figures.stats.bytes,
        "transfer_s": figures.stats.seconds,
        "landing_s": figures.landing_s,
        "verify_s": figures.verify_s,
        "reloaded": list(figures.reloaded) if figures.reloaded is not None else None,
        # Which weights now answer: the version a response can be tagged with.
        "digest": version.digest if version is not None else None,
        "weight_version": version.label if version is not None else None,
    }


class RefitWorkerExtension:
    """kube-refit's refits on one vLLM worker; the driver is ``VllmRefit``."""

    _refit: RefitLanding | AdapterLanding | None = None

    def refit_connect(self, env: dict[str, str] | None = None) -> None:
        """Start a session for the rank in ``env`` (default: this process's ``REFIT_*``
        environment); it connects in the background at the first refit."""
        if self._refit is not None:
            raise RuntimeError("a refit session is already open: refit_close() it first")
        worker: Any = self
        config = WorkerConfig.from_env(env if env else os.environ)
        if config.transfer.adapter is not None:  # refits are LoRA adapters (docs/adapters.md)
            self._refit = open_adapter_landing(worker, config)
            return
        self._refit = open_landing(
            worker.vllm_config, worker.model_runner.get_model, self._refit_reload, env
        )

    def _refit_reload(self, weights: Mapping[str, torch.Tensor]) -> None:
        """vLLM's in-place reload by HF names (a test-only subclass plants faults here);
        the tensors are taken one by one (a tensor-parallel worker's are made so)."""
        worker: Any = self
        worker.reload_weights(weights_iterator=weights.items())

    def refit_pending(self) -> list[int]:
        """The refit ids this session still has to take (from where its gang resumes)."""
        return list(self._refit_require().receiver.session.pending_refits)

    def refit_begin(self, refit_id: int, verified_as: Verification | None = None) -> None:
        """Start receiving refit ``refit_id`` in the background; generation goes on."""
        self._refit_require().begin(refit_id, verified_as=verified_as)

    def refit_ready(self) -> bool:
        """Whether :meth:`refit_land` would not wait (staged, or failed)."""
        return self._refit_require().receiver.ready()

    def refit_land(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Land the begun refit once staged (the driver holds generation meanwhile): a
        :class:`~refit_worker.integrations.vllm.landing.Landed` as plain data, plus
        ``stale_caches`` (the engine's caches the driver must now clear).
        Raises what stopped the refit (``Preempted``...), ``LayoutRefused`` (the engine
        untouched) or ``LandingError``."""
        landing = self._refit_require()
        landed = landing.land(timeout_s)
        return {**landed.plain(), "stale_caches": list(landing.stale_caches)}

    def refit_caches_cleared(self) -> None:
        """The driver cleared the engine's caches after the landing (``VllmRefit.land``)."""
        self._refit_require().caches_cleared()

    def refit_commit(self, verify_s: float = 0.0) -> dict[str, Any]:
        """Commit the landed refit (after the caller's check, which took ``verify_s``)."""
        return figures_plain(self._refit_require().commit(verify_s))

    def refit_served_version(self) -> dict[str, Any] | None:
        """The version this worker serves (``refit_id``, ``digest``, ``weight_version``),
        None before its first commit: what a response can say produced it."""
        version = self._refit_require().receiver.session.served_version
        if version is None:
            return None
        return {
            "refit_id": version.refit,
            "digest": version.digest,
            "weight_version": version.label,
        }

    def refit_backend_version(self) -> str | None:
        """The label of the refit this worker's ``kube-refit`` backend committed last (the
        registry path: ``VllmBackendRefit``); None before its first commit."""
        worker: Any = self
        label: str | None = worker.weight_transfer_engine.served_label()
        return label

    def refit_backend_state(self) -> dict[str, Any]:
        """The ``kube-refit`` backend's state (pending, staged, ready, weight version,
        last error) for a driver outside the engine (``vllm serve``: :mod:`.server`)."""
        worker: Any = self
        state: dict[str, Any] = worker.weight_transfer_engine.state()
        return state

    def refit_adapter_versions(self) -> dict[str, Any]:
        """The adapter versions loaded (name -> vLLM LoRA id, oldest first) and the default."""
        landing = self._refit_require()
        if not isinstance(landing, AdapterLanding):
            raise RuntimeError("this session's refits are whole weights, not adapters")
        return {"loaded": dict(landing.versions.loaded), "default": landing.versions.default}

    def refit_reject(self, reason: str) -> None:
        """Refuse the refit in flight (e.g. its tokens differ): it is not committed."""
        landing = self._refit_require()
        if isinstance(landing, AdapterLanding):  # also unloads the version it loaded
            landing.reject(reason)
        else:
            landing.receiver.reject(reason)

    def refit_close(self) -> None:
        """Close the session (idempotent); the engine keeps serving what it has."""
        if self._refit is not None:
            self._refit.receiver.close()
            self._refit = None

    def _refit_require(self) -> RefitLanding | AdapterLanding:
        if self._refit is None:
            raise RuntimeError("no refit session: call refit_connect() first")
        return self._refit
