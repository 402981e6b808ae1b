"""The ``"kube-refit"`` backend of vLLM's weight-transfer registry.

Loaded by vLLM's ``WeightTransferEngineFactory`` (registered by
:func:`refit_worker.integrations.vllm.register_backend`) when the engine runs with
``weight_transfer_config={"backend": "kube-refit"}``; it subclasses vLLM's
``WeightTransferEngine``, so this module imports vLLM at its top and only vLLM's factory
imports it.  The RL framework then drives it with vLLM's own calls:

- ``init_weight_transfer_engine({"env": {...}})`` (optional ``env``: the rank's
  ``REFIT_*`` variables, default this process's; ``prefetch``, default true: start
  receiving the next pending refit in the background right away, and again after every
  commit, so ``update_weights`` finds it staged and only lands it; ``verified_as``:
  what the caller checks before ``finish_weight_update``);
- ``start_weight_update()``; ``update_weights({"refit_id": k})``: waits until refit ``k``
  is staged and verified, then lands it through vLLM's in-place reload (HF names);
  ``finish_weight_update()``: commits and reports it.

The engine's caches (prefix, multimodal, encoder) live in its scheduler, out of this
backend's reach: the caller clears them around the update (vLLM's ``/pause`` with
``clear_cache``, or ``LLM.reset_prefix_cache()``; :class:`.driver.VllmBackendRefit` does)
and says so with ``update_weights({"refit_id": k, "caches_cleared": true})``.  Without
it, a refit committed while prefix caching is on claims only the session's own checks.

Imports vLLM (only ever loaded inside a vLLM worker).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload.inplace import reload_weights

from refit_worker.contract.entries import Verification
from refit_worker.contract.failures import exit_code_for, one_line
from refit_worker.integrations.staged import CommittedFigures
from refit_worker.integrations.vllm.landing import RefitLanding
from refit_worker.integrations.vllm.worker_part import open_landing


@dataclass
class RefitInitInfo(WeightTransferInitInfo):
    env: dict[str, str] | None = None
    prefetch: bool = True
    verified_as: Verification | None = None


@dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    refit_id: int = field(default=-1)
    #: The caller cleared the engine's caches for this update (and serves nothing from
    #: the new weights before they are cleared).
    caches_cleared: bool = False


class RefitWeightTransferEngine(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    """Receives each refit with a kube-refit session; lands it with vLLM's reload."""

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._landing: RefitLanding | None = None
        self._info = RefitInitInfo()
        self._landed: int | None = None
        #: The last committed refit's split into phases (for the caller and the bench).
        self.last_committed: CommittedFigures | None = None
        #: Why the last update failed, as plain data (``type``, ``message``,
        #: ``exit_code``): a driver behind HTTP sees only a status code otherwise.
        self.last_error: dict[str, Any] | None = None

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        if self._landing is not None:
            raise RuntimeError("the kube-refit backend is already initialised")

        def reload(weights: Mapping[str, torch.Tensor]) -> None:
            reload_weights(
                self.vllm_config,
                self.model,
                weights_iterator=weights.items(),
                weights_path=None,
                is_checkpoint_format=True,
            )

        self._landing = open_landing(self.vllm_config, lambda: self.model, reload, init_info.env)
        self._info = init_info
        self._prefetch()

    def start_weight_update(self) -> None:
        self._require()  # the landing itself is one reload in update_weights

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # Not the base class's: it synchronises an accelerator, and there may be none.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        landing = self._require()
        receiver = landing.receiver
        try:
            if receiver.in_flight != update_info.refit_id:
                if receiver.in_flight is not None:
                    receiver.reject(f"the trainer asked for refit {update_info.refit_id} instead")
                landing.begin(update_info.refit_id, verified_as=self._info.verified_as)
            self._landed = landing.land().refit_id
        except Exception as exc:
            self.last_error = {
                "type": type(exc).__name__,
                "message": one_line(exc),
                "exit_code": exit_code_for(exc),
            }
            raise
        self.last_error = None
        if update_info.caches_cleared:
            landing.caches_cleared()

    def finish_weight_update(self) -> None:
        landing = self._require()
        if self._landed is None:
            raise RuntimeError("finish_weight_update without a landed refit")
        self.last_committed = landing.commit()
        self._landed = None
        self._prefetch()

    def served_label(self) -> str | None:
        """The weight version of the refit committed last (``refit-<k>@<digest>``)."""
        if self._landing is None:
            return None
        version = self._landing.receiver.session.served_version
        return version.label if version is not None else None

    def state(self) -> dict[str, Any]:
        """Where the backend stands, as plain data for a driver that polls it (``vllm
        serve``: :mod:`.server`): ``pending`` (refit ids still to take), ``staged`` (the
        refit received in the background, if any) and ``ready`` (``update_weights`` for it
        would not wait), ``weight_version`` (the last commit's label), ``error``."""
        landing = self._require()
        receiver = landing.receiver
        return {
            "pending": list(receiver.session.pending_refits),
            "staged": receiver.in_flight,
            "ready": receiver.in_flight is not None and receiver.ready(),
            "weight_version": self.served_label(),
            "error": self.last_error,
        }

    def shutdown(self) -> None:
        if self._landing is not None:
            self._landing.receiver.close()
            self._landing = None

    def _prefetch(self) -> None:
        landing = self._require()
        if not self._info.prefetch:
            return
        pending = landing.receiver.session.pending_refits
        if len(pending) and landing.receiver.in_flight is None:
            landing.begin(pending[0], verified_as=self._info.verified_as)

    def _require(self) -> RefitLanding:
        if self._landing is None:
            raise RuntimeError("init_weight_transfer_engine was not called")
        return self._landing
