"""The driver's side: what the process holding a ``vllm.LLM`` does around each landing.

A landing changes the weights, not what the engine computed from them: the prefix
cache's KV blocks (every prompt that shares a prefix with an earlier one reuses them),
the multimodal and encoder caches.  Those live in vLLM's scheduler, out of the workers'
reach, so the driver clears them right after the weights land and before anything is
generated from them (:func:`clear_caches`, vLLM's own calls), and tells the workers, who
claim a served level only then.  It also names the weights the engine answers with
(vLLM's *weight version*, on every ``RequestOutput`` as ``weight_versions``): the
committed refit and its digest (``refit-<k>@<digest>``).

- :class:`VllmRefit` drives kube-refit's worker extension (``refit_*`` methods);
- :class:`VllmBackendRefit` drives vLLM's own weight-transfer calls with the
  ``kube-refit`` backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from refit_worker.contract.entries import Verification
from refit_worker.integrations.vllm.landing import Landed

#: The weight version between a landing and its commit: the refit's weights, unproven.
LANDING_SUFFIX = "@landing"


def clear_caches(llm: Any) -> None:
    """Forget everything vLLM computed from earlier weights: the prefix cache, the
    multimodal cache, the encoder cache.  Raises when vLLM refuses (requests running)."""
    if not llm.reset_prefix_cache():
        raise RuntimeError(
            "vLLM did not reset its prefix cache (requests still running?): its KV blocks "
            "of the previous weights could serve prompts that share a prefix"
        )
    llm.reset_mm_cache()
    llm.llm_engine.reset_encoder_cache()


def weight_versions(output: Any) -> list[str]:
    """The weight versions that produced a ``RequestOutput``'s first completion, in token
    order (one unless a landing fell inside the request)."""
    spans = output.outputs[0].weight_versions or []
    return [span.version for span in spans]


class VllmRefit:
    """Drives :class:`~refit_worker.integrations.vllm.extension.RefitWorkerExtension` on
    every worker of ``llm`` (a ``vllm.LLM`` built with ``worker_extension_cls``).

    Calls return the first worker's answer (every worker answers alike for its rank),
    except where the workers differ: with tensor parallelism each worker is a rollout rank
    of its own, so :meth:`ready` waits for all, :meth:`land` reports the layers any worker
    could not read back, and :meth:`commit` lists each worker's figures (``workers``)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def _rpc(self, method: str, **kwargs: Any) -> Any:
        return self._all(method, **kwargs)[0]

    def _all(self, method: str, **kwargs: Any) -> list[Any]:
        return list(self.llm.collective_rpc(method, kwargs=kwargs))

    def connect(self, env: Mapping[str, str] | None = None) -> None:
        self._rpc("refit_connect", env=dict(env) if env is not None else None)

    def pending(self) -> list[int]:
        return list(self._rpc("refit_pending"))

    def begin(self, refit_id: int, verified_as: Verification | None = None) -> None:
        self._rpc("refit_begin", refit_id=refit_id, verified_as=verified_as)

    def ready(self) -> bool:
        return all(self._all("refit_ready"))

    def land(self, timeout_s: float | None = None) -> Landed:
        """Land the begun refit on every worker, clear the engine's caches, and label what
        it now serves ``refit-<k>@landing`` until the commit (extras as plain lists)."""
        answers = [dict(answer) for answer in self._all("refit_land", timeout_s=timeout_s)]
        plain = answers[0]
        # The weakest over the workers: a layer unprobed on any of them is unprobed.
        plain["unprobed"] = sorted({n for answer in answers for n in answer["unprobed"]})
        stale = plain.pop("stale_caches")
        if stale:
            clear_caches(self.llm)
            self._rpc("refit_caches_cleared")
        self.llm.update_weight_version(f"refit-{plain['refit_id']}{LANDING_SUFFIX}")
        plain["reloaded"] = tuple(plain["reloaded"])
        plain["probed"], plain["unprobed"] = tuple(plain["probed"]), tuple(plain["unprobed"])
        return Landed(**plain)

    def commit(self, verify_s: float = 0.0) -> dict[str, Any]:
        """Commit the landed refit; the engine's weight version becomes its label."""
        workers = [dict(answer) for answer in self._all("refit_commit", verify_s=verify_s)]
        figures = {**workers[0], "workers": workers}
        if figures["weight_version"] is not None:
            self.llm.update_weight_version(figures["weight_version"])
        return figures

    def reject(self, reason: str) -> None:
        self._rpc("refit_reject", reason=reason)

    def close(self) -> None:
        self._rpc("refit_close")


class VllmBackendRefit:
    """Drives vLLM's own weight-transfer calls (``start_weight_update`` /
    ``update_weights`` / ``finish_weight_update``) for the ``kube-refit`` backend of an
    offline ``vllm.LLM``, with the caches cleared and the weight version set.

    The offline engine generates only inside ``generate``, so clearing before
    ``start_weight_update`` leaves nothing computed from the old weights by the time the
    new ones answer; the backend is told so (``caches_cleared``) and claims its served
    level.  The engine also needs the worker extension (``worker_extension_cls=
    WORKER_EXTENSION``): the label of the committed refit is read through it."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init(self, env: Mapping[str, str] | None = None, **init_info: Any) -> None:
        info = {"env": dict(env) if env is not None else None, **init_info}
        self.llm.init_weight_transfer_engine({"init_info": info})

    def update(self, refit_id: int) -> str | None:
        """Land refit ``refit_id`` and commit it; returns the weight version set."""
        clear_caches(self.llm)
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": {"refit_id": refit_id, "caches_cleared": True}})
        self.llm.finish_weight_update()
        version: str | None = self.llm.collective_rpc("refit_backend_version")[0]
        if version is not None:
            self.llm.update_weight_version(version)
        return version

    def close(self) -> None:
        self.llm.shutdown_weight_transfer_engine()
