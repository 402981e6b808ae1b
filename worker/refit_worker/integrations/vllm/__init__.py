"""kube-refit inside vLLM: refits received over NIXL, landed through vLLM's own loader.

Two ways in, one landing (:class:`~.landing.RefitLanding`):

- the worker extension, for ``LLM(..., worker_extension_cls=WORKER_EXTENSION)``
  (:mod:`.extension`), driven by :class:`VllmRefit` (:mod:`.driver`);
- the weight-transfer backend ``"kube-refit"`` (:mod:`.backend`), for
  ``weight_transfer_config={"backend": "kube-refit"}`` and vLLM's own
  ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
  ``finish_weight_update`` calls (:class:`VllmBackendRefit` makes them for an offline
  ``LLM``).  Importing this package inside a process that has vLLM loaded registers it
  (the extension's import does so in every vLLM worker); so does vLLM's plugin loader
  through the ``vllm.general_plugins`` entry point when kube-refit is installed.

The rooms: :mod:`.landing` (stage, check the layout, land, read back, commit),
:mod:`.served` (redo what vLLM's reload leaves stale; read the served layers back, with
:mod:`.served_experts` and :mod:`.served_modules`), :mod:`.driver` (the ``LLM`` holder's
side: caches cleared after each landing, the weight version set), :mod:`.extension`,
:mod:`.backend`.

Each refit: received in the background into the session's registered staging memory
(generation goes on), checked whole (manifest, integrity hashes), mapped onto the
checkpoint's names (:mod:`refit_worker.integrations.hf_names`), its names and shapes
checked against the served checkpoint, then landed in one ``reload_weights`` call while
the driver holds generation (the landing is the only pause), read back from the served
layers (a refit whose served weights differ is rejected: :class:`LandingError`, and the
rank must exit, never serve the mixed model), the engine's caches cleared, optionally
checked by the caller (e.g. greedy tokens against the trainer's), then committed and
reported with the split into transfer, landing and verification seconds.  A refit that
fails or is preempted before landing never touches the engine.

No private attribute of vLLM is read or written.  vLLM is imported only inside the functions
that run in a vLLM process, so this package loads where vLLM is absent.
"""

from __future__ import annotations

import contextlib
import sys

from refit_worker.integrations.vllm.adapter_driver import VllmAdapterRefit
from refit_worker.integrations.vllm.adapter_landing import (
    AdapterLanding,
    AdapterRefused,
    AdapterVersionUnknown,
)
from refit_worker.integrations.vllm.driver import (
    VllmBackendRefit,
    VllmRefit,
    clear_caches,
    weight_versions,
)
from refit_worker.integrations.vllm.extension import RefitWorkerExtension
from refit_worker.integrations.vllm.landing import (
    Landed,
    LandingError,
    LayoutRefused,
    RefitLanding,
    checkpoint_layout,
    layout_problems,
    vllm_landing,
)

#: The qualified name to pass as ``worker_extension_cls``.
WORKER_EXTENSION = "refit_worker.integrations.vllm.extension.RefitWorkerExtension"
#: The name of the weight-transfer backend in vLLM's registry.
BACKEND = "kube-refit"


def register_backend() -> None:
    """Register the ``"kube-refit"`` weight-transfer backend with vLLM (idempotent).

    The ``vllm.general_plugins`` entry point of kube-refit calls this in every vLLM
    process; importing this package does it where vLLM is already loaded."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # ValueError: already registered (the plugin and the import both ran).
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(
            BACKEND, "refit_worker.integrations.vllm.backend", "RefitWeightTransferEngine"
        )


if "vllm" in sys.modules:  # inside a vLLM process: make the backend available
    register_backend()

__all__ = [
    "BACKEND",
    "WORKER_EXTENSION",
    "AdapterLanding",
    "AdapterRefused",
    "AdapterVersionUnknown",
    "Landed",
    "LandingError",
    "LayoutRefused",
    "RefitLanding",
    "RefitWorkerExtension",
    "VllmAdapterRefit",
    "VllmBackendRefit",
    "VllmRefit",
    "checkpoint_layout",
    "clear_caches",
    "layout_problems",
    "register_backend",
    "vllm_landing",
    "weight_versions",
]
