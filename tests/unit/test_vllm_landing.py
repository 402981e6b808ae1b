"""When a vLLM landing reloads only a delta's modules, and when it must land whole; what
it claims while the engine's caches may still answer from older weights; a layout no
replacement can cure.

:class:`RefitLanding` with a stand-in receiver (refits handed over as staged) and a
stand-in engine (a dict of served tensors that ``land`` writes into and ``check`` reads
back); the real landing into vLLM runs in the engines tier.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from refit_worker import DeltaChanges, RefitStats
from refit_worker.contract.exits import EXIT_NOT_RETRYABLE
from refit_worker.contract.failures import exit_code_for
from refit_worker.integrations.staged import CommittedFigures, StagedReceiver, StagedRefit
from refit_worker.integrations.vllm import LandingError, LayoutRefused, RefitLanding
from refit_worker.integrations.vllm.served import ServedReport

NAMES = ("a.weight", "b.weight", "c.weight")


class Receiver:
    """Hands over the refits it was given, one per ``staged()``; records the verdicts."""

    def __init__(self, refits: list[StagedRefit]) -> None:
        self.refits = refits
        self.rejected: list[str] = []
        self.committed: list[int] = []
        #: The claim each commit made where it differs from the one begun (None: as begun).
        self.claims: list[str | None] = []
        self.current: StagedRefit | None = None
        self.in_flight: int | None = None
        config = SimpleNamespace(role="rollout", transfer=SimpleNamespace(checksum=True))
        self.session = SimpleNamespace(config=config)

    def begin(self, refit_id: int, verified_as: Any = None) -> None:
        self.current = self.refits.pop(0)
        assert self.current.refit_id == refit_id

    def staged(self, timeout_s: float | None = None) -> StagedRefit:
        assert self.current is not None
        return self.current

    def reject(self, reason: str) -> None:
        self.rejected.append(reason)

    def commit(
        self, *, landing_s: float, verify_s: float = 0.0, reloaded: Any = None, claim: Any = None
    ) -> CommittedFigures:
        assert self.current is not None
        self.committed.append(self.current.refit_id)
        self.claims.append(claim)
        stats = RefitStats(self.current.refit_id, 0, 0.0)
        return CommittedFigures(stats, landing_s, verify_s, None, reloaded)


class Engine:
    """Serves a dict; ``break_subsets``: a subset landing leaves one tensor unwritten."""

    def __init__(self) -> None:
        self.served = {n: torch.zeros(2) for n in NAMES}
        self.calls: list[frozenset[str] | None] = []
        self.break_subsets = False

    def land(
        self, weights: dict[str, torch.Tensor], changed: frozenset[str] | None
    ) -> Collection[str]:
        self.calls.append(changed)
        names = set(weights) if changed is None else set(changed)
        if changed is not None and self.break_subsets:
            names.discard(min(names))
        for n in names:
            self.served[n] = weights[n].clone()
        return names

    def check(self, weights: Mapping[str, torch.Tensor]) -> ServedReport:
        wrong = [n for n in NAMES if not torch.equal(self.served[n], weights[n])]
        return ServedReport(probed=list(NAMES), mismatches=wrong)


def refit(k: int, values: tuple[float, ...], delta: DeltaChanges | None = None) -> StagedRefit:
    weights = {n: torch.full((2,), v) for n, v in zip(NAMES, values, strict=True)}
    return StagedRefit(k, weights, {}, 0.0, delta)


def landing(
    refits: list[StagedRefit], engine: Engine, complete: bool = True, caches: tuple[str, ...] = ()
) -> tuple[RefitLanding, Receiver]:
    receiver = Receiver(refits)
    served = {n: (2,) for n in NAMES}
    check = engine.check if complete else None
    land = RefitLanding(
        cast(StagedReceiver, receiver), engine.land, served, check, complete, caches=caches
    )
    return land, receiver


def take(land: RefitLanding, k: int, commit: bool = True) -> None:
    land.begin(k)
    land.land()
    if commit:
        land.commit()


def after_a_whole_refit(
    second: StagedRefit, complete: bool = True
) -> tuple[Engine, RefitLanding, Receiver]:
    """Refit 0 landed whole and committed, then ``second``."""
    engine = Engine()
    land, receiver = landing([refit(0, (1, 1, 1)), second], engine, complete)
    take(land, 0)
    take(land, second.refit_id)
    return engine, land, receiver


def test_a_delta_onto_the_served_refit_lands_its_changes_alone() -> None:
    engine, land, receiver = after_a_whole_refit(
        refit(1, (1, 2, 1), DeltaChanges(0, frozenset({"b.weight"})))
    )
    assert engine.calls == [None, frozenset({"b.weight"})]
    assert land.reloaded == (1, 3)
    assert receiver.committed == [0, 1] and not receiver.rejected
    assert [float(engine.served[n][0]) for n in NAMES] == [1, 2, 1]


def test_after_a_landing_that_was_not_committed_the_next_delta_lands_whole() -> None:
    engine = Engine()
    land, receiver = landing(
        [
            refit(0, (1, 1, 1)),
            refit(1, (1, 2, 1), DeltaChanges(0, frozenset({"b.weight"}))),
            refit(2, (3, 1, 1), DeltaChanges(0, frozenset({"a.weight"}))),
        ],
        engine,
    )
    take(land, 0)
    take(land, 1, commit=False)  # the caller's check refused refit 1 after it landed
    receiver.reject("tokens differ")
    take(land, 2)  # onto refit 0, which the engine no longer serves
    assert engine.calls == [None, frozenset({"b.weight"}), None]
    assert receiver.committed == [0, 2]
    assert [float(engine.served[n][0]) for n in NAMES] == [3, 1, 1]


def test_a_delta_onto_another_refit_lands_whole() -> None:
    engine, _, _ = after_a_whole_refit(
        refit(2, (1, 1, 5), DeltaChanges(1, frozenset({"c.weight"})))
    )
    assert engine.calls == [None, None]


def test_a_subset_that_serves_wrong_is_landed_again_whole_and_so_is_every_later_refit() -> None:
    engine = Engine()
    engine.break_subsets = True
    land, receiver = landing(
        [
            refit(0, (1, 1, 1)),
            refit(1, (2, 2, 1), DeltaChanges(0, frozenset({"a.weight", "b.weight"}))),
            refit(2, (2, 2, 7), DeltaChanges(1, frozenset({"c.weight"}))),
        ],
        engine,
    )
    take(land, 0)
    take(land, 1)
    assert engine.calls == [None, frozenset({"a.weight", "b.weight"}), None]
    assert land.report is not None and not land.report.mismatches
    take(land, 2)
    assert engine.calls[-1] is None
    assert receiver.committed == [0, 1, 2] and not receiver.rejected
    assert [float(engine.served[n][0]) for n in NAMES] == [2, 2, 7]


def test_a_whole_landing_that_serves_wrong_fails_the_refit() -> None:
    engine = Engine()
    engine.land = lambda weights, changed: []  # type: ignore[method-assign]  # lands nothing
    land, receiver = landing([refit(0, (1, 1, 1))], engine)
    land.begin(0)
    with pytest.raises(LandingError, match=r"served weights differ: a\.weight; b\.weight"):
        land.land()
    assert receiver.rejected and not receiver.committed


def test_without_a_complete_read_back_every_refit_lands_whole() -> None:
    engine, _, _ = after_a_whole_refit(
        refit(1, (1, 2, 1), DeltaChanges(0, frozenset({"b.weight"}))), complete=False
    )
    assert engine.calls == [None, None]


def test_fused_experts_changed_map_onto_the_checkpoints_per_expert_names() -> None:
    fused = "m.experts.gate_up_proj"
    served = {f"m.experts.{e}.{w}_proj.weight": (1, 2) for e in range(2) for w in ("gate", "up")}
    served["m.norm.weight"] = (2,)
    weights = {fused: torch.ones(2, 2, 2), "m.norm.weight": torch.ones(2)}
    seen: list[frozenset[str] | None] = []

    def land_(w: dict[str, torch.Tensor], changed: frozenset[str] | None) -> Collection[str]:
        seen.append(changed)
        return list(w)

    receiver = Receiver(
        [
            StagedRefit(0, weights, {}, 0.0),
            StagedRefit(1, weights, {}, 0.0, DeltaChanges(0, frozenset({fused, "refit.x"}))),
        ]
    )
    check = lambda w: ServedReport()  # noqa: E731
    land = RefitLanding(cast(StagedReceiver, receiver), land_, served, check, complete=True)
    take(land, 0)
    take(land, 1)
    assert seen == [None, frozenset(n for n in served if ".experts." in n)]


def test_a_cache_left_from_older_weights_lowers_the_claim_until_the_driver_clears_it() -> None:
    engine = Engine()
    refits = [refit(0, (1, 1, 1)), refit(1, (2, 2, 2)), refit(2, (3, 3, 3))]
    land, receiver = landing(refits, engine, caches=("prefix cache",))
    assert land.stale_caches == ()
    land.begin(0)
    land.land()
    assert land.stale_caches == ("prefix cache",)
    land.commit()  # nobody cleared it: only the session's own check (its hashes) is claimed
    land.begin(1)
    land.land()
    land.caches_cleared()
    assert land.stale_caches == ()
    land.commit()  # cleared: the claim stays as begun (the read-back's served-params)
    take(land, 2)  # a new landing makes the cleared cache stale again
    assert receiver.claims == ["checksums", None, "checksums"]
    assert receiver.committed == [0, 1, 2]


def test_an_engine_without_such_caches_keeps_its_claim() -> None:
    engine = Engine()
    land, receiver = landing([refit(0, (1, 1, 1))], engine)
    take(land, 0)
    assert receiver.claims == [None] and land.stale_caches == ()


def test_a_layout_the_served_model_lacks_is_refused_as_not_retryable_naming_the_tensors() -> None:
    engine = Engine()
    odd = StagedRefit(0, {"a.weight": torch.ones(2), "z.weight": torch.ones(2)}, {}, 0.0)
    land, receiver = landing([odd], engine)
    land.begin(0)
    with pytest.raises(LayoutRefused) as refused:
        land.land()
    message = str(refused.value)
    assert "missing 'b.weight'" in message and "unexpected 'z.weight'" in message
    assert exit_code_for(refused.value) == EXIT_NOT_RETRYABLE
    assert isinstance(refused.value, LandingError)  # callers' `except LandingError` holds
    assert engine.calls == [] and receiver.rejected and not receiver.committed
