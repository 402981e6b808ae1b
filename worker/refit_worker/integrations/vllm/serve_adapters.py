"""``refit-vllm-serve`` for adapter jobs: every committed adapter refit registered with the
server through vLLM's dynamic LoRA endpoints.

With ``transfer.adapter`` set, the rank's driver process (not the server) holds the
session: it receives each adapter refit, checks it (:class:`~.adapter_landing.AdapterLanding`:
the header, the base digest against the checkpoint the server serves, the tensors), writes
it as a PEFT adapter into the pod's tmpfs and registers it with
``POST /v1/load_lora_adapter`` as ``<name>-v<refit>`` (the directory is removed once the
call returned: vLLM loads the adapter during the call).  The commit makes it the default
(one JSON line, ``{"adapter": {"default": ..., "loaded": [...]}}``, for whoever routes
requests) and unregisters the versions beyond ``keep`` with ``/v1/unload_lora_adapter``:
a request naming one then gets vLLM's "does not exist" error naming it, never another
version.  vLLM mounts both endpoints only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``.

No read-back over HTTP: the claim is the session's integrity hashes (as with tensor
parallelism in the worker extension).
"""

from __future__ import annotations

import urllib.error
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from refit_worker.contract.adapters import checkpoint_digest, version_name
from refit_worker.contract.config import WorkerConfig
from refit_worker.integrations.staged import StagedReceiver
from refit_worker.integrations.vllm.adapter_landing import AdapterLanding
from refit_worker.integrations.vllm.server import VllmServer
from refit_worker.rollout.rollout_session import RolloutSession

#: vLLM mounts /v1/load_lora_adapter and /v1/unload_lora_adapter only with this set.
RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
#: vLLM's default ``--max-loras``.
VLLM_MAX_LORAS = 1


def _option(options: Sequence[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``options`` (the last one wins)."""
    value = None
    for i, opt in enumerate(options):
        if opt == name and i + 1 < len(options):
            value = options[i + 1]
        elif opt.startswith(name + "="):
            value = opt.split("=", 1)[1]
    return value


def serve_lora_problem(options: Sequence[str], keep: int) -> str | None:
    """Why ``vllm serve`` with ``options`` cannot serve adapter refits keeping ``keep``
    versions (None: it can).  The kept versions and the one landing must all stay
    registered: past ``--max-cpu-loras`` (default ``--max-loras``) vLLM's LRU cache would
    evict one and reload it from a directory that is gone."""
    if "--enable-lora" not in options:
        return "adapter refits need vllm serve started with --enable-lora"
    raw = _option(options, "--max-cpu-loras") or _option(options, "--max-loras")
    try:
        capacity = VLLM_MAX_LORAS if raw is None else int(raw)
    except ValueError:
        return f"--max-loras / --max-cpu-loras {raw!r}: not a number"
    if capacity < keep + 1:
        return (
            f"transfer.adapter.keep={keep} needs vLLM to hold {keep + 1} adapters (the kept "
            f"versions and the one landing), but it holds {capacity}: pass --max-loras "
            f"{keep + 1} (or --max-cpu-loras) or lower keep"
        )
    return None


class ServerLoras:
    """The load and unload calls of :class:`AdapterLanding`, made over the server's
    dynamic LoRA endpoints (vLLM's own LoRA ids are its business: versions go by name)."""

    def __init__(self, server: VllmServer, adapter: str) -> None:
        self.server, self.adapter = server, adapter

    def _post(self, path: str, body: dict[str, Any]) -> None:
        try:
            self.server.post(path, body)
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:400].decode(errors="replace")
            raise RuntimeError(f"POST {path} answered {exc.code}: {detail}") from exc

    def load(self, version: str, lora_id: int, directory: Path) -> None:
        self._post("/v1/load_lora_adapter", {"lora_name": version, "lora_path": str(directory)})

    def unload(self, lora_id: int) -> None:
        # lora ids are refit + 1 (adapter_landing.lora_id_of)
        self._post(
            "/v1/unload_lora_adapter", {"lora_name": version_name(self.adapter, lora_id - 1)}
        )


def served_adapter_landing(
    server: VllmServer, config: WorkerConfig, model: str, stop: Callable[[], bool]
) -> AdapterLanding:
    """The driver's :class:`AdapterLanding` for ``config``'s adapter job, registering each
    version with ``server``; the base is ``model``, a local checkpoint directory; ``stop``:
    the job's signal arrived (the driver's own handler)."""
    knobs = config.transfer.adapter
    if knobs is None:
        raise ValueError("transfer.adapter is not set: this job's refits are whole weights")
    if not Path(model).is_dir():
        raise ValueError(
            f"adapter refits need the served base as a local checkpoint directory to digest "
            f"it; vllm serve was given {model!r}"
        )
    adapter = knobs.name or config.job
    calls = ServerLoras(server, adapter)
    session = RolloutSession(config, stop_requested=stop)
    return AdapterLanding(
        StagedReceiver(session),
        adapter=adapter,
        keep=knobs.keep,
        base=model,
        base_digest=checkpoint_digest(model),
        load=calls.load,
        unload=calls.unload,
    )


def serve_adapter_refits(
    landing: AdapterLanding, on_committed: Callable[[dict[str, Any]], None]
) -> list[str]:
    """Take every pending adapter refit: land (register) it, commit it as the default;
    the versions committed, in order.  A refused refit raises (nothing of it served)."""
    committed: list[str] = []
    try:
        for refit in landing.receiver.session.pending_refits:
            landing.begin(refit)
            landed = landing.land()
            figures = landing.commit()
            committed.append(landed.version)
            on_committed(
                {
                    "refit_id": landed.refit_id,
                    "default": landing.versions.default,
                    "loaded": list(landing.versions.loaded),
                    "landing_s": landed.landing_s,
                    "transfer_s": figures.stats.seconds,
                }
            )
    finally:
        landing.receiver.close()
    return committed
