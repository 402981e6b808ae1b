"""The driver's side of adapter refits: which adapter version a request is served by.

:class:`VllmAdapterRefit` drives the worker extension's adapter refits (a job with
``transfer.adapter``) for the process holding a ``vllm.LLM`` built with
``enable_lora=True``.  After each commit it knows the versions the workers keep loaded and
the default (the newest); :meth:`VllmAdapterRefit.request` gives the ``LoRARequest`` to
generate with: the default, or the version a caller names, or
:class:`~.adapter_landing.AdapterVersionUnknown` naming it, never another version.
"""

from __future__ import annotations

from typing import Any

from refit_worker.integrations.vllm.adapter_landing import AdapterVersionUnknown
from refit_worker.integrations.vllm.driver import VllmRefit


class VllmAdapterRefit(VllmRefit):
    """:class:`VllmRefit` for adapter refits; see the module docstring."""

    def __init__(self, llm: Any) -> None:
        super().__init__(llm)
        #: Version name -> vLLM LoRA id, oldest first, as the workers keep them loaded.
        self.loaded: dict[str, int] = {}
        self.default: str | None = None
        #: The version landed and not yet committed (name, LoRA id): only a request that
        #: names it gets it (the caller's check before the commit), never the default.
        self.landing: tuple[str, int] | None = None

    def land(self, timeout_s: float | None = None) -> Any:  # an AdapterLanded as a dict
        """Load the begun adapter refit as a new version on every worker and read it back
        (not yet the default: :meth:`commit` makes it so)."""
        plain = dict(self._rpc("refit_land", timeout_s=timeout_s))
        plain.pop("stale_caches")  # none: vLLM keys cached KV blocks by the adapter too
        self.landing = (plain["version"], plain["lora_id"])
        return plain

    def commit(self, verify_s: float = 0.0) -> dict[str, Any]:
        """Commit the landed version: it becomes the default; versions beyond ``keep``
        are unloaded on the workers and forgotten here."""
        figures = dict(self._rpc("refit_commit", verify_s=verify_s))
        versions = self._rpc("refit_adapter_versions")
        self.loaded, self.default = dict(versions["loaded"]), versions["default"]
        self.landing = None
        return {**figures, "adapter_version": self.default, "loaded": list(self.loaded)}

    def reject(self, reason: str) -> None:
        """Refuse the landed version (e.g. its tokens differ); the workers unload it."""
        super().reject(reason)
        self.landing = None

    def request(self, version: str | None = None) -> Any:
        """The ``LoRARequest`` serving ``version`` (None: the default), for ``generate``;
        :class:`AdapterVersionUnknown` naming it when it is not loaded."""
        from vllm.lora.request import LoRARequest

        name = self.default if version is None else version
        if name is None:
            raise AdapterVersionUnknown("no adapter version is committed yet")
        if self.landing is not None and name == self.landing[0]:
            return LoRARequest(name, self.landing[1], f"kube-refit:{name}")
        if name not in self.loaded:
            raise AdapterVersionUnknown(
                f"adapter version {name!r} is not loaded (loaded: {sorted(self.loaded)}); "
                "it was unloaded or never committed, and no other version answers for it"
            )
        # The path is not read again: the workers hold the adapter (loaded from a tmpfs).
        return LoRARequest(name, self.loaded[name], f"kube-refit:{name}")
