"""A test-only vLLM worker extension that plants a fault in the landing.

:class:`SkipOneTensor` is :class:`~refit_worker.integrations.vllm.extension.RefitWorkerExtension`
whose reload leaves out the tensor ``$ENGINE_SKIP_TENSOR`` on the landing number
``$ENGINE_SKIP_AT`` (0-based): the refit arrived whole and passed every check before
landing, and vLLM's loader then serves the old values of that one tensor (its layer keeps
its previous weights).  Only the engines tier uses it; the fault is the only thing
emulated.
"""

from __future__ import annotations

import os
from typing import Any

from refit_worker.integrations.vllm import RefitWorkerExtension

#: The qualified name to pass as ``worker_extension_cls``.
FAULTY_EXTENSION = "tests.engines.fault_extension.SkipOneTensor"


class SkipOneTensor(RefitWorkerExtension):
    _landings = 0

    def _refit_reload(self, weights: dict[str, Any]) -> None:
        skip_at = int(os.environ.get("ENGINE_SKIP_AT", "-1"))
        if self._landings == skip_at:
            skipped = os.environ["ENGINE_SKIP_TENSOR"]
            weights = {n: t for n, t in weights.items() if n != skipped}
        self._landings += 1
        super()._refit_reload(weights)
