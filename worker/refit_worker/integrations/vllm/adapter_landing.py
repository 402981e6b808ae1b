"""One vLLM worker's adapter refits: each committed one served as a LoRA adapter of its own.

:class:`AdapterLanding` is the adapter counterpart of
:class:`~refit_worker.integrations.vllm.landing.RefitLanding` (same calls: ``begin``,
``land``, ``caches_cleared``, ``commit``), for jobs with ``transfer.adapter`` set.  A staged
adapter refit is checked before anything is loaded: its header parses, its base is the
one served (:func:`~refit_worker.contract.adapters.base_refusal`, naming both digests),
its tensors are the adapter the header describes.  It is then written as a PEFT adapter
into a directory of the pod's tmpfs, loaded into vLLM as ``<name>-v<refit>`` (the
directory removed at once: vLLM 0.32's ``LoRARequest`` takes a path only), read back from
vLLM's LoRA manager and compared with what was sent.  The commit makes it the default and
unloads the versions beyond ``keep``.  A refused or failed refit leaves the versions
loaded before it serving as they were: the base weights are never touched.

The vLLM calls are given as functions (:func:`.served_lora.lora_calls`), so the checks
run where vLLM is absent too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch

from refit_worker.contract.adapters import (
    ADAPTER_EXTRA,
    AdapterHeader,
    adapter_problems,
    base_refusal,
    checkpoint_digest,
    header_json,
    version_name,
)
from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.entries import Verification
from refit_worker.integrations.staged import (
    CommittedFigures,
    StagedReceiver,
    StagedRefit,
    stop_flag,
)
from refit_worker.integrations.vllm.landing import LandingError, LayoutRefused

#: ``load(version, lora_id, directory)``: vLLM loads the PEFT adapter in ``directory``.
Load = Callable[[str, int, Path], None]
#: ``unload(lora_id)``: vLLM forgets that adapter.
Unload = Callable[[int], None]
#: ``read_back(lora_id, header, weights)``: how the served A/B differ from ``weights``.
ReadBack = Callable[[int, AdapterHeader, Mapping[str, torch.Tensor]], list[str]]


class AdapterRefused(LayoutRefused):
    """The adapter refit does not apply to the served base (or is no adapter): nothing
    was loaded, and no replacement can cure it."""


class AdapterVersionUnknown(LookupError):
    """A request named an adapter version that is not loaded (never, or no longer)."""


def lora_id_of(refit: int) -> int:
    """vLLM's LoRA id of refit ``refit`` (ids start at 1)."""
    return refit + 1


def tmpfs_root() -> Path:
    """Where adapters are written for vLLM to load: the pod's tmpfs (``/dev/shm``) when
    there is one, so nothing goes through a disk."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


@dataclass(frozen=True)
class AdapterLanded:
    """An adapter refit loaded into vLLM and read back, not yet committed."""

    refit_id: int
    version: str
    lora_id: int
    landing_s: float
    staged_after_s: float
    extras: dict[str, torch.Tensor]
    #: The LoRA modules whose A and B were read back equal to those sent.
    probed: tuple[str, ...] = ()

    def plain(self) -> dict[str, Any]:
        return {
            "refit_id": self.refit_id,
            "version": self.version,
            "lora_id": self.lora_id,
            "landing_s": self.landing_s,
            "staged_after_s": self.staged_after_s,
            "extras": {n: t.tolist() for n, t in self.extras.items()},
            "probed": list(self.probed),
        }


@dataclass
class _Versions:
    """The versions loaded, oldest first, and the default (the last committed)."""

    loaded: dict[str, int] = field(default_factory=dict)
    default: str | None = None


class AdapterLanding:
    """One vLLM worker's adapter refits; see the module docstring."""

    stale_caches: tuple[str, ...] = ()  # vLLM keys cached KV blocks by the LoRA too

    def __init__(
        self,
        receiver: StagedReceiver,
        *,
        adapter: str,
        keep: int,
        base: str,
        base_digest: str,
        load: Load,
        unload: Unload,
        read_back: ReadBack | None = None,
    ) -> None:
        self.receiver, self.adapter, self.keep = receiver, adapter, keep
        self.base, self.base_digest = base, base_digest
        self._load, self._unload, self._read_back = load, unload, read_back
        self.versions = _Versions()
        self._landed: AdapterLanded | None = None
        self._check_s = 0.0

    def begin(self, refit_id: int, verified_as: Verification | None = None) -> None:
        """Start receiving ``refit_id``; with a read-back the claim is ``served-params``."""
        own: Verification | None = "served-params" if self._read_back is not None else None
        self.receiver.begin(refit_id, verified_as=verified_as or own)

    def caches_cleared(self) -> None:
        """Nothing to do: a new adapter's requests never meet another adapter's KV blocks."""

    def land(self, timeout_s: float | None = None) -> AdapterLanded:
        """Check the staged adapter refit, load it as a new version, read it back.
        :class:`AdapterRefused` (nothing loaded) or :class:`LandingError` (the new version
        unloaded again; the ones before it serve as they did)."""
        staged = self.receiver.staged(timeout_s)
        header = self._admit(staged)
        version, lora_id = version_name(header.name, staged.refit_id), lora_id_of(staged.refit_id)
        started = time.perf_counter()
        # One directory per process: workers of one host (tensor parallel) share the tmpfs.
        directory = tmpfs_root() / f"kube-refit-{self.adapter}-{os.getpid()}"
        try:
            write_peft_adapter(directory, header, staged.weights)
            self._load(version, lora_id, directory)
        except Exception as exc:
            why = f"vLLM did not load adapter {version}: {exc}"
            self._refuse(staged.refit_id, why, LandingError, exc)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        loaded = time.perf_counter()
        mismatches = (
            [] if self._read_back is None else self._read_back(lora_id, header, staged.weights)
        )
        self._check_s = time.perf_counter() - loaded
        if mismatches:
            self._unload(lora_id)
            why = f"the served A/B of {version} differ from those sent: {mismatches[:5]}"
            self._refuse(staged.refit_id, why, LandingError)
        probed = tuple(sorted({n.rsplit(".lora_", 1)[0] for n in staged.weights}))
        self._landed = AdapterLanded(
            staged.refit_id, version, lora_id, loaded - started, staged.staged_after_s,
            {n: t for n, t in staged.extras.items() if n != ADAPTER_EXTRA},
            probed if self._read_back is not None else (),
        )  # fmt: skip
        return self._landed

    def _admit(self, staged: StagedRefit) -> AdapterHeader:
        """The refit's header, once the refit is known to apply here (else refused)."""
        raw = staged.extras.get(ADAPTER_EXTRA)
        if raw is None:
            self._refuse(staged.refit_id, "carries no adapter header (a whole-weights refit?)")
        try:
            header = header_json(raw.tolist())
        except ValueError as exc:
            self._refuse(staged.refit_id, f"has an invalid adapter header: {exc}")
        why = base_refusal(header, self.base, self.base_digest)
        if why is None and header.name != self.adapter:
            why = f"names adapter {header.name!r}; this rollout serves {self.adapter!r}"
        if why is None:
            shapes = {n: tuple(t.shape) for n, t in staged.weights.items()}
            problems = adapter_problems(header, shapes)
            why = "; ".join(problems[:5]) if problems else None
        if why is not None:
            self._refuse(staged.refit_id, why)
        return header

    def _refuse(
        self,
        refit: int,
        why: str,
        error: type[LandingError] = AdapterRefused,
        cause: Exception | None = None,
    ) -> NoReturn:
        self.receiver.reject(why)
        raise error(f"adapter refit {refit} refused: {why}; nothing of it is served") from cause

    def reject(self, reason: str) -> None:
        """Refuse the landed version (the caller's check failed): it is unloaded, the
        default stays the version committed before it."""
        if self._landed is not None:
            self._unload(self._landed.lora_id)
            self._landed = None
        self.receiver.reject(reason)

    def commit(self, verify_s: float = 0.0) -> CommittedFigures:
        """Commit the landed version: it becomes the default, and the versions beyond
        ``keep`` (oldest first) are unloaded."""
        landed = self._landed
        if landed is None:
            raise RuntimeError("no adapter refit landed: call land() first")
        n = len(landed.probed) * 2
        figures = self.receiver.commit(
            landing_s=landed.landing_s, verify_s=verify_s + self._check_s, reloaded=(n, n)
        )
        self.versions.loaded[landed.version] = landed.lora_id
        self.versions.default = landed.version
        for old in list(self.versions.loaded)[: -self.keep]:
            self._unload(self.versions.loaded.pop(old))
        self._landed = None
        return figures


def write_peft_adapter(
    directory: Path, header: AdapterHeader, weights: Mapping[str, torch.Tensor]
) -> None:
    """``weights`` as a PEFT adapter directory (``adapter_config.json`` and
    ``adapter_model.safetensors``), which vLLM's LoRA loader reads."""
    import json

    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(header.peft_config()))
    tensors = {n: t.detach().contiguous() for n, t in weights.items()}
    save_file(tensors, str(directory / "adapter_model.safetensors"))


def open_adapter_landing(worker: Any, config: WorkerConfig) -> AdapterLanding:
    """The rollout session of an adapter job on this vLLM ``worker``, and its landing."""
    from refit_worker.rollout.rollout_session import RolloutSession

    tp_size = int(worker.vllm_config.parallel_config.tensor_parallel_size)
    if tp_size > 1:
        # Each TP worker would take the whole adapter under one rank, and the LoRA
        # read-back is per worker only at TP 1: refused rather than half served.
        raise ValueError(
            f"adapter refits (transfer.adapter) run at tensor_parallel_size 1 only; this "
            f"vLLM has {tp_size}"
        )
    session = RolloutSession(config, stop_requested=stop_flag(config))
    return adapter_landing(StagedReceiver(session), config, worker)


def adapter_landing(receiver: StagedReceiver, config: WorkerConfig, worker: Any) -> AdapterLanding:
    """The :class:`AdapterLanding` of a vLLM ``worker`` for ``config``'s adapter job: the
    base is the checkpoint vLLM serves (a local directory: its digest is read from it)."""
    from refit_worker.integrations.vllm.served_lora import lora_calls

    knobs = config.transfer.adapter
    if knobs is None:
        raise ValueError("transfer.adapter is not set: this job's refits are whole weights")
    problem = lora_capacity_problem(worker.vllm_config.lora_config, knobs.keep)
    if problem is not None:
        raise ValueError(problem)
    model = str(worker.vllm_config.model_config.model)
    if not Path(model).is_dir():
        raise ValueError(
            f"adapter refits need the served base as a local checkpoint directory to digest "
            f"it; vLLM serves {model!r}"
        )
    return AdapterLanding(
        receiver,
        adapter=knobs.name or config.job,
        keep=knobs.keep,
        base=model,
        base_digest=checkpoint_digest(model),
        **lora_calls(worker),
    )


def lora_capacity_problem(lora_config: Any, keep: int) -> str | None:
    """Why a vLLM engine with ``lora_config`` cannot serve adapter refits keeping ``keep``
    versions (None: it can).  The versions kept and the one being checked before its
    commit must all stay registered: past vLLM's ``max_cpu_loras`` its LRU cache would
    silently evict one that a request may still name."""
    if lora_config is None:
        return "adapter refits need vLLM started with enable_lora=True (--enable-lora)"
    capacity = int(lora_config.max_cpu_loras or lora_config.max_loras)
    if capacity < keep + 1:
        return (
            f"transfer.adapter.keep={keep} needs vLLM to hold {keep + 1} adapters (the kept "
            f"versions and the one landing), but max_cpu_loras is {capacity}: raise "
            f"max_loras / max_cpu_loras to {keep + 1} or lower keep"
        )
    return None
