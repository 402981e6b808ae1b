"""One vLLM worker's refits: staged, checked against the served model, landed, read back.

:class:`RefitLanding` is the engine-facing half that the worker extension and the
registry backend share: each refit is received whole by a
:class:`~refit_worker.integrations.staged.StagedReceiver`, mapped onto the served
checkpoint's names (:mod:`refit_worker.integrations.hf_names`), its names and shapes
checked against that checkpoint (a mismatch no replacement can cure:
:class:`LayoutRefused`, nothing landed), landed through vLLM's in-place reload, and read
back through the engine's own kernels (:mod:`.served`).  :meth:`RefitLanding.land`
returns a typed :class:`Landed`.

What a landing does not reach: the engine's caches computed from the previous weights
(the prefix cache's KV blocks, the multimodal and encoder caches).  They live in vLLM's
scheduler, not in the worker, so the driver clears them (:mod:`.driver`) and says so
(:meth:`RefitLanding.caches_cleared`); a refit committed while such a cache may still
answer claims only what the session itself checked, never what the engine serves.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from refit_worker.contract.entries import VERIFICATION_ORDER, Verification
from refit_worker.contract.failures import NotRetryableError
from refit_worker.integrations.hf_names import checkpoint_model_type, to_checkpoint_names
from refit_worker.integrations.staged import CommittedFigures, StagedReceiver, StagedRefit
from refit_worker.integrations.vllm.served import ServedReport, describe
from refit_worker.session.reporting import default_verification

Layout = dict[str, tuple[int, ...]]
log = logging.getLogger(__name__)


class LandingError(RuntimeError):
    """A staged refit cannot land (layout differs from the served model) or failed to."""


class LayoutRefused(LandingError, NotRetryableError):
    """The refit's names or shapes do not fit the served model: nothing landed, and a
    replacement would meet the same trainer and the same checkpoint (exit not retryable)."""


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


def served_checkpoint(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``served`` layout and ``model_type`` of a :class:`RefitLanding` for the
    checkpoint vLLM serves from ``model_dir``."""
    return {"served": checkpoint_layout(model_dir), "model_type": checkpoint_model_type(model_dir)}


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


#: Reads the served state back after a landing (:func:`.served.check_served`).
ServedCheck = Callable[[Mapping[str, torch.Tensor]], ServedReport]
#: ``land(weights, changed)``: put ``weights`` (every served tensor, by checkpoint names)
#: into the engine: all of them (``changed`` None), or only the whole modules that the
#: ``changed`` ones feed, the rest being what the engine serves already; returns the names
#: it reloaded.
Land = Callable[[dict[str, torch.Tensor], frozenset[str] | None], Collection[str]]


@dataclass(frozen=True)
class Landed:
    """A refit landed in the engine and read back, not yet committed."""

    refit_id: int
    landing_s: float
    #: Seconds from ``begin`` until the refit was staged (the wait plus the transfer).
    staged_after_s: float
    #: Tensors sent along that are no weights (``refit.extra.<name>``), by ``<name>``.
    extras: dict[str, torch.Tensor]
    #: The tensors the landing reloaded, of the refit's (fewer for a delta's modules).
    reloaded: tuple[int, int]
    #: The read-back: the layers it proved, and those it could not read.
    probed: tuple[str, ...] = ()
    unprobed: tuple[str, ...] = ()

    def plain(self) -> dict[str, Any]:
        """As plain data (extras as nested lists), for vLLM's RPC between processes."""
        return {
            "refit_id": self.refit_id,
            "landing_s": self.landing_s,
            "staged_after_s": self.staged_after_s,
            "extras": {n: t.tolist() for n, t in self.extras.items()},
            "reloaded": list(self.reloaded),
            "probed": list(self.probed),
            "unprobed": list(self.unprobed),
        }


def _stronger(a: Verification | None, b: Verification | None) -> Verification | None:
    if a is None or b is None:
        return a or b
    return max(a, b, key=VERIFICATION_ORDER.index)


class RefitLanding:
    """One vLLM worker's refits: a :class:`StagedReceiver`, landing through vLLM, and
    the read-back of what vLLM then serves.

    ``check`` (optional) reads the served state back after every landing; ``complete``:
    it covers every layer, so a refit it passes is claimed as ``served-params``.
    ``model_type``: the served checkpoint's family (``config.json``), whose conversion
    mapping in transformers names the trainer's tensors as the checkpoint does.
    ``caches``: the engine's caches that hold results of the weights and outlive a
    landing (e.g. ``("prefix cache",)``); each landing leaves them stale until the driver
    cleared them and called :meth:`caches_cleared`.

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
        *,
        caches: tuple[str, ...] = (),
        model_type: str | None = None,
    ) -> None:
        self.receiver, self._land, self._served = receiver, land, served
        #: The served checkpoint's family: transformers' conversion mapping for it names
        #: the trainer's in-memory tensors as the checkpoint does.
        self._model_type = model_type
        self._check, self._complete = check, complete and check is not None
        self._caches = caches
        self._stale: tuple[str, ...] = ()
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

    @property
    def stale_caches(self) -> tuple[str, ...]:
        """The engine's caches computed from weights older than the last landing, which
        may still answer requests (empty once the driver cleared them)."""
        return self._stale

    def caches_cleared(self) -> None:
        """The driver cleared every cache of the engine after the last landing (and before
        anything was served from the new weights)."""
        self._stale = ()

    def land(self, timeout_s: float | None = None) -> Landed:
        """Wait for the begun refit to be staged, check its layout, land it, read the
        served state back.  Refused before landing: :class:`LayoutRefused`, the engine
        untouched.  A failure inside vLLM's loader, or served weights that differ from
        those sent: :class:`LandingError` saying that the engine serves a mixed model
        (the rank must exit so it is replaced)."""
        staged = self.receiver.staged(timeout_s)
        weights = to_checkpoint_names(staged.weights, self._served, model_type=self._model_type)
        problems = layout_problems(self._served, weights)
        if problems:
            reason = "does not match the served model: " + "; ".join(problems[:5])
            self.receiver.reject(reason)
            raise LayoutRefused(
                f"refit {staged.refit_id} {reason}; nothing landed, and no replacement can "
                "cure it (the trainer's names and shapes against the served checkpoint)"
            )
        changed = self._changed(staged, weights)
        self._serves = None  # until the commit: the engine serves neither refit
        self._stale = self._caches
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
        return Landed(
            refit_id=staged.refit_id,
            landing_s=self._landing_s,
            staged_after_s=staged.staged_after_s,
            extras=staged.extras,
            reloaded=self.reloaded,
            probed=tuple(report.probed) if report is not None else (),
            unprobed=tuple(report.unprobed) if report is not None else (),
        )

    def _changed(
        self, staged: StagedRefit, weights: Mapping[str, torch.Tensor]
    ) -> frozenset[str] | None:
        """The checkpoint tensors in which the staged refit differs from what the engine
        serves; None: it may differ in any (land it whole)."""
        delta = staged.delta
        if delta is None or not self._subsets or delta.base_refit != self._serves:
            return None
        sent = {n: t for n, t in staged.weights.items() if n in delta.changed}
        named = to_checkpoint_names(sent, self._served, model_type=self._model_type)
        return frozenset(named) & weights.keys()

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
        """Commit the landed refit.  While a cache computed from older weights may still
        answer (:attr:`stale_caches`), the engine does not serve exactly this refit: the
        claim falls to what the session itself checked (its integrity hashes), and a
        warning names the caches."""
        # The read-back is verification too: the reported split counts it there.
        verify_s += self._check_s
        claim: Verification | None = None
        if self._stale:
            claim = default_verification(self.receiver.session.config)
            log.warning(
                "refit %s committed while the engine's %s may still answer from the "
                "previous weights: claiming only %r (clear them after each landing: "
                "VllmRefit.land does, or pause with clear_cache)",
                self.receiver.in_flight,
                " and ".join(self._stale),
                claim,
            )
        figures = self.receiver.commit(
            landing_s=self._landing_s, verify_s=verify_s, reloaded=self.reloaded, claim=claim
        )
        self._serves = figures.stats.refit_id
        return figures


#: A tensor-parallel worker's received parts -> tensors vLLM's loader takes (the
#: checkpoint's shapes, the part in place): :meth:`.worker_part.WorkerPart.widen`.
Widen = Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]


def vllm_landing(
    vllm_config: Any,
    get_model: Callable[[], Any],
    reload: Callable[[Mapping[str, Any]], None],
    widen: Widen | None = None,
    described: Collection[str] = (),
) -> dict[str, Any]:
    """The ``land``, ``check``, ``complete`` and ``caches`` of a :class:`RefitLanding`
    inside vLLM: ``reload`` (vLLM's in-place reload) of every tensor or of the modules a
    delta's changes feed, then the one-time processing it leaves stale redone for what it
    rebuilt; the check reads every layer of ``get_model()`` back.  A tensor-parallel
    worker receives parts: ``widen`` makes them what the loader takes, and the check reads
    the ``described`` layers' parts back."""
    from refit_worker.integrations.vllm import served

    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)

    def loader(weights: Mapping[str, torch.Tensor]) -> None:
        reload(widen(weights) if widen is not None else weights)

    def land(weights: dict[str, torch.Tensor], changed: frozenset[str] | None) -> Collection[str]:
        model = get_model()
        if changed is None:
            loader(weights)
            served.redo_processing(model)
            return weights.keys()
        subset = served.landing_for(model, weights.keys(), changed)
        if subset.names:
            loader({n: t for n, t in weights.items() if n in subset.names})
            served.redo_processing(model, subset.modules)
        return subset.names

    def check(weights: Mapping[str, torch.Tensor]) -> ServedReport:
        return served.check_served(get_model(), weights, tp_size, described)

    complete = not served.unreadable(get_model(), tp_size, described)
    return {"land": land, "check": check, "complete": complete, "caches": caches_of(vllm_config)}


def caches_of(vllm_config: Any) -> tuple[str, ...]:
    """The caches of a vLLM engine that keep results of its weights across a landing."""
    caches: list[str] = []
    if getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        caches.append("prefix cache")
    if getattr(vllm_config.model_config, "is_multimodal_model", False):
        caches.append("multimodal and encoder caches")
    return tuple(caches)
