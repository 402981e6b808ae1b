"""The controller creates a round's children in dependency order (issue #11: a RoleBinding
created beside its Role met HTTP 404 from the apiserver's escalation check)."""

from __future__ import annotations

from tests.support.operator_run import load_job

from refit_operator.api.models import parse_spec
from refit_operator.apply.applier import creation_waves
from refit_operator.render.children import render_static
from refit_operator.render.pods import JobRef, RenderOptions, render_gang


def test_rolebinding_after_its_role_and_pods_last() -> None:
    job = JobRef("demo", "default", "uid-1")
    spec = parse_spec(load_job()["spec"])
    objs = [*render_gang(job, spec, 0, RenderOptions()), *render_static(job, spec)]
    waves = [[o["kind"] for o in wave] for wave in creation_waves(objs)]
    assert [set(w) for w in waves] == [
        {"Secret", "ServiceAccount", "Role", "Service", "ConfigMap"},
        {"RoleBinding"},
        {"Pod"},
    ]
    assert sum(len(w) for w in waves) == len(objs)


def test_order_within_a_wave_is_kept_and_empty_waves_dropped() -> None:
    pods = [{"kind": "Pod", "metadata": {"name": f"p{i}"}} for i in range(3)]
    assert creation_waves(pods) == [pods]
    assert creation_waves([]) == []
