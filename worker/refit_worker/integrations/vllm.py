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

What of vLLM this touches: ``Worker.reload_weights(weights_iterator=...)`` (vLLM's
in-place reload: the model's ``load_weights`` with HF names between
``initialize_layerwise_reload`` and ``finalize_layerwise_reload``, so fusing qkv/gate_up,
tensor-parallel slicing and the CPU/oneDNN repacking stay vLLM's), then the one-time
post-load steps that reload leaves stale, redone with vLLM's own methods
(:func:`.vllm_served.redo_processing`: a tied ``lm_head``'s
``quant_method.process_weights_after_loading``, the MoE kernel's
``fused_experts.process_weights_after_loading``), then the read-back of every served layer
(:func:`.vllm_served.check_served`: ``quant_method.apply`` / ``embedding`` on probe inputs,
the fused experts' ``forward_modular`` on a probe routed to each expert, the model's
``hf_to_vllm_mapper``); ``Worker.model_runner.get_model()``;
``Worker.vllm_config`` (``model_config.model``: the checkpoint directory whose tensor names
and shapes a refit must match before it lands; ``parallel_config.tensor_parallel_size``);
``WeightTransferEngineFactory.register_engine`` and the ``WeightTransferEngine`` base class
(the backend); ``LLM.collective_rpc`` (the driver).  No private attribute of vLLM is read
or written.

Each refit: received in the background into the session's registered staging memory
(generation goes on), checked whole (manifest, integrity hashes), mapped onto the
checkpoint's names (fused transformers-5 experts, :mod:`.hf_names`), its names and shapes
checked against the served checkpoint, then landed in one ``reload_weights`` call while
the driver holds generation (the landing is the only pause), read back from the served
layers (a refit whose served weights differ is rejected: :class:`LandingError`, and the
rank must exit, never serve the mixed model), optionally checked by the caller (e.g.
greedy tokens against the trainer's), then committed and reported with the split into
transfer, landing and verification seconds.  A refit that fails or is preempted before
landing never touches the engine.

Must not import: the operator; vLLM at module import time (only inside functions that run
in a vLLM process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch

from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.entries import VERIFICATION_ORDER, Verification
from refit_worker.integrations.hf_names import to_checkpoint_names
from refit_worker.integrations.staged import (
    CommittedFigures,
    StagedReceiver,
    StagedRefit,
    stop_flag,
)
from refit_worker.integrations.vllm_served import ServedReport, describe
from refit_worker.session import RolloutSession

#: The qualified name to pass as ``worker_extension_cls``.
WORKER_EXTENSION = "refit_worker.integrations.vllm.RefitWorkerExtension"
#: The name of the weight-transfer backend in vLLM's registry.
BACKEND = "kube-refit"

Layout = dict[str, tuple[int, ...]]
log = logging.getLogger(__name__)


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


#: Reads the served state back after a landing (:func:`.vllm_served.check_served`).
ServedCheck = Callable[[Mapping[str, torch.Tensor]], ServedReport]
#: ``land(weights, changed)``: put ``weights`` (every served tensor, by checkpoint names)
#: into the engine: all of them (``changed`` None), or only the whole modules that the
#: ``changed`` ones feed, the rest being what the engine serves already; returns the names
#: it reloaded.
Land = Callable[[dict[str, torch.Tensor], frozenset[str] | None], Collection[str]]


def _stronger(a: Verification | None, b: Verification | None) -> Verification | None:
    if a is None or b is None:
        return a or b
    return max(a, b, key=VERIFICATION_ORDER.index)


class RefitLanding:
    """One vLLM worker's refits: a :class:`StagedReceiver`, landing through vLLM, and
    the read-back of what vLLM then serves.

    ``check`` (optional) reads the served state back after every landing; ``complete``:
    it covers every layer, so a refit it passes is claimed as ``served-params``.

    A refit that came as a delta onto the refit the engine serves (committed, and nothing
    landed since) lands only the modules its changed tensors feed, and only where the
    read-back is complete: it then proves the untouched modules too.  Should that
    read-back find a difference, the refit is landed again whole and read back again, and
    every later refit lands whole."""

    def __init__(
        self,
        receiver: StagedReceiver,
        land: Land,
        served: Layout | None,
        check: ServedCheck | None = None,
        complete: bool = False,
    ) -> None:
        self.receiver, self._land, self._served = receiver, land, served
        self._check, self._complete = check, complete and check is not None
        self._landing_s = self._check_s = 0.0
        #: The last landing's read-back (None: no check, or none yet).
        self.report: ServedReport | None = None
        #: The last landing: the tensors it reloaded, and how many the refit has.
        self.reloaded: tuple[int, int] = (0, 0)
        #: The refit the engine serves as committed; None: the checkpoint it started
        #: from, or a landing since then that was not committed (it serves neither).
        self._serves: int | None = None
        self._subsets = self._complete

    def begin(self, refit_id: int, verified_as: Verification | None = None) -> None:
        """Start receiving ``refit_id``; the claim is the stronger of the caller's check
        and this landing's own read-back (which rejects the refit when it fails)."""
        own: Verification | None = "served-params" if self._complete else None
        self.receiver.begin(refit_id, verified_as=_stronger(verified_as, own))

    def land(self, timeout_s: float | None = None) -> tuple[StagedRefit, float]:
        """Wait for the begun refit to be staged, check its layout, land it, read the
        served state back; returns it and the landing seconds.  Refused before landing:
        :class:`LandingError`, the engine untouched.  A failure inside vLLM's loader, or
        served weights that differ from those sent: :class:`LandingError` saying that
        the engine serves a mixed model (the rank must exit so it is replaced)."""
        staged = self.receiver.staged(timeout_s)
        weights = to_checkpoint_names(staged.weights, self._served)
        problems = layout_problems(self._served, weights)
        if problems:
            reason = "does not match the served model: " + "; ".join(problems[:5])
            self.receiver.reject(reason)
            raise LandingError(f"refit {staged.refit_id} {reason}; nothing landed")
        changed = self._changed(staged, weights)
        self._serves = None  # until the commit: the engine serves neither refit
        self._landing_s = self._check_s = 0.0
        report = self._land_and_check(staged.refit_id, weights, changed)
        if report is not None and report.mismatches and changed is not None:
            log.warning(
                "refit %d: the landing of the modules its changes feed (%d of %d tensors) "
                "served wrong (%s); landing it whole, and every refit from now on",
                staged.refit_id,
                self.reloaded[0],
                len(weights),
                describe(report),
            )
            self._subsets = False
            report = self._land_and_check(staged.refit_id, weights, None)
        if report is not None and report.mismatches:
            self._fail(staged.refit_id, f"served weights differ: {describe(report)}")
        return staged, self._landing_s

    def _changed(
        self, staged: StagedRefit, weights: Mapping[str, torch.Tensor]
    ) -> frozenset[str] | None:
        """The checkpoint tensors in which the staged refit differs from what the engine
        serves; None: it may differ in any (land it whole)."""
        delta = staged.delta
        if delta is None or not self._subsets or delta.base_refit != self._serves:
            return None
        sent = {n: t for n, t in staged.weights.items() if n in delta.changed}
        return frozenset(to_checkpoint_names(sent, self._served)) & weights.keys()

    def _land_and_check(
        self, refit_id: int, weights: dict[str, torch.Tensor], changed: frozenset[str] | None
    ) -> ServedReport | None:
        started = time.perf_counter()
        try:
            reloaded = self._land(weights, changed)
        except Exception as exc:
            self._fail(refit_id, f"vLLM's loader failed part-way ({exc})", exc)
        self.reloaded = (len(reloaded), len(weights))
        checked = time.perf_counter()
        self._landing_s += checked - started
        self.report = report = self._check(weights) if self._check is not None else None
        self._check_s += time.perf_counter() - checked
        if changed is not None:
            log.info(
                "refit %d: a delta changed %d of %d tensors; landed the %d tensors of the "
                "modules they feed in %.4f s",
                refit_id,
                len(changed),
                len(weights),
                len(reloaded),
                checked - started,
            )
        return report

    def _fail(self, refit_id: int, why: str, cause: Exception | None = None) -> NoReturn:
        self.receiver.reject(why)
        raise LandingError(
            f"refit {refit_id}: {why}; vLLM serves a mixed model: do not serve, exit so "
            "that this replica is replaced and takes a whole refit"
        ) from cause

    def commit(self, verify_s: float = 0.0) -> CommittedFigures:
        # The read-back is verification too: the reported split counts it there.
        verify_s += self._check_s
        figures = self.receiver.commit(
            landing_s=self._landing_s, verify_s=verify_s, reloaded=self.reloaded
        )
        self._serves = figures.stats.refit_id
        return figures


def vllm_landing(
    vllm_config: Any, get_model: Callable[[], Any], reload: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """The ``land``, ``check`` and ``complete`` of a :class:`RefitLanding` inside vLLM:
    ``reload`` (vLLM's in-place reload) of every tensor or of the modules a delta's
    changes feed, then the one-time processing it leaves stale redone for what it
    rebuilt; the check reads every layer of ``get_model()`` back."""
    from refit_worker.integrations import vllm_served

    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)

    def land(weights: dict[str, torch.Tensor], changed: frozenset[str] | None) -> Collection[str]:
        model = get_model()
        if changed is None:
            reload(weights)
            vllm_served.redo_processing(model)
            return weights.keys()
        subset = vllm_served.landing_for(model, weights.keys(), changed)
        if subset.names:
            reload({n: t for n, t in weights.items() if n in subset.names})
            vllm_served.redo_processing(model, subset.modules)
        return subset.names

    def check(weights: Mapping[str, torch.Tensor]) -> ServedReport:
        return vllm_served.check_served(get_model(), weights, tp_size)

    complete = not vllm_served.unreadable(get_model(), tp_size)
    return {"land": land, "check": check, "complete": complete}


def _figures(figures: CommittedFigures) -> dict[str, Any]:
    return {
        "refit_id": figures.stats.refit_id,
        "bytes": figures.stats.bytes,
        "transfer_s": figures.stats.seconds,
        "landing_s": figures.landing_s,
        "verify_s": figures.verify_s,
        "reloaded": list(figures.reloaded) if figures.reloaded is not None else None,
        # Which weights now answer: the version a response can be tagged with.
        "digest": figures.version.digest if figures.version is not None else None,
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
        session = RolloutSession(config, stop_requested=stop_flag(config))
        worker: Any = self
        served = checkpoint_layout(worker.vllm_config.model_config.model)

        self._refit = RefitLanding(
            StagedReceiver(session),
            served=served,
            **vllm_landing(
                worker.vllm_config,
                worker.model_runner.get_model,
                self._refit_reload,
            ),
        )

    def _refit_reload(self, weights: dict[str, torch.Tensor]) -> None:
        """vLLM's in-place reload by HF names (a test-only subclass plants faults here)."""
        worker: Any = self
        worker.reload_weights(weights_iterator=list(weights.items()))

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
        """Land the begun refit once staged (the driver holds generation meanwhile).

        Returns ``refit_id``, ``landing_s``, ``staged_after_s``, ``extras`` (the refit's
        extra tensors as lists), ``reloaded`` (the tensors reloaded, of the refit's: fewer
        for a delta, which lands only the modules its changes feed), and the read-back's
        ``probed`` and ``unprobed`` layers.
        Raises what stopped the refit (``Preempted``...) or :class:`LandingError`; the
        engine's weights are then untouched."""
        landing = self._refit_require()
        staged, landing_s = landing.land(timeout_s)
        report = landing.report or ServedReport()
        return {
            "refit_id": staged.refit_id,
            "landing_s": landing_s,
            "staged_after_s": staged.staged_after_s,
            "extras": {n: t.tolist() for n, t in staged.extras.items()},
            "reloaded": list(landing.reloaded),
            "probed": list(report.probed),
            "unprobed": list(report.unprobed),
        }

    def refit_commit(self, verify_s: float = 0.0) -> dict[str, Any]:
        """Commit the landed refit (after the caller's check, which took ``verify_s``)."""
        return _figures(self._refit_require().commit(verify_s))

    def refit_served_version(self) -> dict[str, Any] | None:
        """The version this worker serves (``refit_id`` and ``digest``), None before its
        first commit: what a response can say produced it."""
        version = self._refit_require().receiver.session.served_version
        if version is None:
            return None
        return {"refit_id": version.refit, "digest": version.digest}

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
