"""kube-refit inside vLLM: refits received over NIXL, landed through vLLM's own loader.

Two ways in, one mechanism (:class:`~refit_worker.integrations.staged.StagedReceiver`):

- :class:`RefitWorkerExtension`, for ``LLM(..., worker_extension_cls=WORKER_EXTENSION)``:
  the driver calls its ``refit_*`` methods with ``llm.collective_rpc`` (see
  :class:`VllmRefit` for the driver side);
- the weight-transfer backend ``"kube-refit"`` (:mod:`.vllm_backend`), for
  ``weight_transfer_config={"backend": "kube-refit"}`` and vLLM's own
  ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
  ``finish_weight_update`` calls.  Importing this module inside a process that has vLLM
  loaded registers it (the extension's import does so in every vLLM worker); so does
  vLLM's plugin loader through the ``vllm.general_plugins`` entry point when kube-refit
  is installed.

What of vLLM this touches, and nothing else: ``Worker.reload_weights(weights_iterator=...)``
(vLLM's in-place reload: the model's ``load_weights`` with HF names between
``initialize_layerwise_reload`` and ``finalize_layerwise_reload``, so fusing qkv/gate_up,
tensor-parallel slicing and the CPU/oneDNN repacking stay vLLM's); ``Worker.vllm_config``
(``model_config.model``: the checkpoint directory whose tensor names and shapes a refit
must match before it lands); ``WeightTransferEngineFactory.register_engine`` and the
``WeightTransferEngine`` base class (the backend); ``LLM.collective_rpc`` (the driver).
No private attribute of vLLM is read or written.

Each refit: received in the background into the session's registered staging memory
(generation goes on), checked whole (manifest, integrity hashes), its names and shapes
checked against the served checkpoint, then landed in one ``reload_weights`` call while the
driver holds generation (the landing is the only pause), optionally checked by the caller
(e.g. greedy tokens against the trainer's), then committed and reported with the split
into transfer, landing and verification seconds.  A refit that fails or is preempted
before landing never touches the engine.

Must not import: the operator; vLLM at module import time (only inside functions that run
in a vLLM process).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.entries import Verification
from refit_worker.integrations.staged import (
    CommittedFigures,
    StagedReceiver,
    StagedRefit,
    stop_flag,
)
from refit_worker.session import RefitSession

#: The qualified name to pass as ``worker_extension_cls``.
WORKER_EXTENSION = "refit_worker.integrations.vllm.RefitWorkerExtension"
#: The name of the weight-transfer backend in vLLM's registry.
BACKEND = "kube-refit"

Layout = dict[str, tuple[int, ...]]


class LandingError(RuntimeError):
    """A staged refit cannot land (layout differs from the served model) or failed to."""


def checkpoint_layout(model_dir: str | os.PathLike[str]) -> Layout | None:
    """``name -> shape`` of every tensor in the ``*.safetensors`` files of ``model_dir``
    (headers only); None when ``model_dir`` is no local directory (a hub id)."""
    root = Path(model_dir)
    if not root.is_dir():
        return None
    from safetensors import safe_open

    layout: Layout = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118  # safe_open has no __iter__
                layout[name] = tuple(handle.get_slice(name).get_shape())
    return layout or None


def layout_problems(served: Layout | None, weights: Mapping[str, torch.Tensor]) -> list[str]:
    """Why ``weights`` cannot replace the served checkpoint's tensors (empty: they can).

    Every served tensor must be sent (a missing one would leave the engine mixing two
    refits) with its shape; nothing else may be sent.  No served layout: nothing to check.
    """
    if served is None:
        return []
    problems = [f"missing {n!r}" for n in sorted(served.keys() - weights.keys())]
    problems += [f"unexpected {n!r}" for n in sorted(weights.keys() - served.keys())]
    problems += [
        f"{n!r} has shape {tuple(weights[n].shape)}, the served model {served[n]}"
        for n in sorted(served.keys() & weights.keys())
        if tuple(weights[n].shape) != served[n]
    ]
    return problems


class RefitLanding:
    """One vLLM worker's refits: a :class:`StagedReceiver` plus landing through vLLM."""

    def __init__(
        self,
        receiver: StagedReceiver,
        land: Callable[[dict[str, torch.Tensor]], None],
        served: Layout | None,
    ) -> None:
        self.receiver, self._land, self._served = receiver, land, served
        self._landing_s = 0.0

    def land(self, timeout_s: float | None = None) -> tuple[StagedRefit, float]:
        """Wait for the begun refit to be staged, check its layout, land it; returns it
        and the landing seconds.  Refused before landing: :class:`LandingError`, the
        engine untouched.  A failure inside vLLM's loader: :class:`LandingError` saying
        the served weights may be partial."""
        staged = self.receiver.staged(timeout_s)
        problems = layout_problems(self._served, staged.weights)
        if problems:
            reason = "does not match the served model: " + "; ".join(problems[:5])
            self.receiver.reject(reason)
            raise LandingError(f"refit {staged.refit_id} {reason}; nothing landed")
        started = time.perf_counter()
        try:
            self._land(staged.weights)
        except Exception as exc:
            self.receiver.reject(f"vLLM's loader failed: {exc}")
            raise LandingError(
                f"refit {staged.refit_id}: vLLM's loader failed part-way ({exc}); the "
                "served weights may mix two refits: land a later refit before serving"
            ) from exc
        self._landing_s = time.perf_counter() - started
        return staged, self._landing_s

    def commit(self, verify_s: float = 0.0) -> CommittedFigures:
        return self.receiver.commit(landing_s=self._landing_s, verify_s=verify_s)


def _figures(figures: CommittedFigures) -> dict[str, Any]:
    return {
        "refit_id": figures.stats.refit_id,
        "bytes": figures.stats.bytes,
        "transfer_s": figures.stats.seconds,
        "landing_s": figures.landing_s,
        "verify_s": figures.verify_s,
    }


class RefitWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``: ``self`` is the worker.

    Called by the driver through ``llm.collective_rpc("refit_<verb>", kwargs=...)``; every
    argument and result is plain data (ints, floats, strings, lists), so it crosses
    vLLM's multiprocess RPC unchanged.  One session per worker: with tensor parallelism
    each worker is a rollout rank of its own and receives the full HF tensors, which
    vLLM's loader slices.
    """

    _refit: RefitLanding | None = None

    def refit_connect(self, env: dict[str, str] | None = None) -> None:
        """Start a session for the rank in ``env`` (default: this process's ``REFIT_*``
        environment); it connects in the background at the first refit."""
        if self._refit is not None:
            raise RuntimeError("a refit session is already open: refit_close() it first")
        config = WorkerConfig.from_env(env if env is not None else os.environ)
        session = RefitSession(config, stop_requested=stop_flag(config))
        worker: Any = self
        served = checkpoint_layout(worker.vllm_config.model_config.model)

        def land(weights: dict[str, torch.Tensor]) -> None:
            worker.reload_weights(weights_iterator=list(weights.items()))

        self._refit = RefitLanding(StagedReceiver(session), land, served)

    def refit_pending(self) -> list[int]:
        """The refit ids this session still has to take (from where its gang resumes)."""
        return list(self._refit_require().receiver.session.pending_refits)

    def refit_begin(self, refit_id: int, verified_as: Verification | None = None) -> None:
        """Start receiving refit ``refit_id`` in the background; generation goes on."""
        self._refit_require().receiver.begin(refit_id, verified_as=verified_as)

    def refit_ready(self) -> bool:
        """Whether :meth:`refit_land` would not wait (staged, or failed)."""
        return self._refit_require().receiver.ready()

    def refit_land(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Land the begun refit once staged (the driver holds generation meanwhile).

        Returns ``refit_id``, ``landing_s``, ``staged_after_s`` and ``extras`` (the
        refit's extra tensors as lists).  Raises what stopped the refit (``Preempted``...)
        or :class:`LandingError`; the engine's weights are then untouched."""
        staged, landing_s = self._refit_require().land(timeout_s)
        return {
            "refit_id": staged.refit_id,
            "landing_s": landing_s,
            "staged_after_s": staged.staged_after_s,
            "extras": {n: t.tolist() for n, t in staged.extras.items()},
        }

    def refit_commit(self, verify_s: float = 0.0) -> dict[str, Any]:
        """Commit the landed refit (after the caller's check, which took ``verify_s``)."""
        return _figures(self._refit_require().commit(verify_s))

    def refit_reject(self, reason: str) -> None:
        """Refuse the refit in flight (e.g. its tokens differ): it is not committed."""
        self._refit_require().receiver.reject(reason)

    def refit_close(self) -> None:
        """Close the session (idempotent); the engine keeps serving what it has."""
        if self._refit is not None:
            self._refit.receiver.close()
            self._refit = None

    def _refit_require(self) -> RefitLanding:
        if self._refit is None:
            raise RuntimeError("no refit session: call refit_connect() first")
        return self._refit


class VllmRefit:
    """The driver's side: drives :class:`RefitWorkerExtension` on every worker of ``llm``.

    ``llm`` is a ``vllm.LLM`` built with ``worker_extension_cls=WORKER_EXTENSION``.  All
    methods return the first worker's answer (every worker answers alike for its rank).
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def _rpc(self, method: str, **kwargs: Any) -> Any:
        return self.llm.collective_rpc(method, kwargs=kwargs)[0]

    def connect(self, env: Mapping[str, str] | None = None) -> None:
        self._rpc("refit_connect", env=dict(env) if env is not None else None)

    def pending(self) -> list[int]:
        return list(self._rpc("refit_pending"))

    def begin(self, refit_id: int, verified_as: Verification | None = None) -> None:
        self._rpc("refit_begin", refit_id=refit_id, verified_as=verified_as)

    def ready(self) -> bool:
        return bool(self._rpc("refit_ready"))

    def land(self, timeout_s: float | None = None) -> dict[str, Any]:
        return dict(self._rpc("refit_land", timeout_s=timeout_s))

    def commit(self, verify_s: float = 0.0) -> dict[str, Any]:
        return dict(self._rpc("refit_commit", verify_s=verify_s))

    def reject(self, reason: str) -> None:
        self._rpc("refit_reject", reason=reason)

    def close(self) -> None:
        self._rpc("refit_close")


def register_backend() -> None:
    """Register the ``"kube-refit"`` weight-transfer backend with vLLM (idempotent).

    The ``vllm.general_plugins`` entry point of kube-refit calls this in every vLLM
    process; importing this module does it where vLLM is already loaded."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # ValueError: already registered (the plugin and the import both ran).
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(
            BACKEND, "refit_worker.integrations.vllm_backend", "RefitWeightTransferEngine"
        )


if "vllm" in sys.modules:  # inside a vLLM process: make the backend available
    register_backend()
