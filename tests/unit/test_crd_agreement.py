"""The CRD and the pydantic models accept and refuse the same RefitJob specs (pure, property).

Specs come from ``tests/support/crd_agreement.py`` (drawn from the CRD's own schema);
each is judged by :func:`parse_spec` and by the generated CRD offline
(``tests/support/crd_judge.py``), and both verdicts must match.

Real: the models, the generated CRD, cel-python.  Nothing emulated.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from tests.support.crd_agreement import run_agreement, specs
from tests.support.crd_judge import crd_verdict, model_verdict


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs)
def test_models_and_crd_agree(spec: dict[str, Any]) -> None:
    crd, model = crd_verdict(spec), model_verdict(spec)
    assert (crd == []) == (model is None), (
        f"disagree on {spec!r}: CRD says {crd or 'valid'}; models say {model or 'valid'}"
    )


def test_the_generator_reaches_both_verdicts() -> None:
    tally = run_agreement(120)
    assert tally.disagreements == []
    assert tally.generated == 120
    # Not a lopsided stream of garbage: both verdicts come up often.
    assert 12 <= tally.model_valid <= 108, tally
