"""``spec.metrics.port``: every rank serves its refit figures on a port the operator names
in the pod (env and ``containerPort``), refused where it cannot work.

Real: the models, the CRD's CEL rule (evaluated by cel-python), the renderer and merge.
"""

from __future__ import annotations

from typing import Any

import celpy
import pytest

from refit_operator.api.crd import crd_manifest
from refit_operator.api.models import InvalidSpecError, parse_spec
from refit_operator.render.merge import TemplateConflict
from refit_operator.render.pods import JobRef, RenderOptions, render_pod
from refit_worker.contract.env import METRICS_PORT_ENV, metrics_port_from_env

JOB = JobRef(name="job", namespace="ns", uid="u-1")


def _spec(metrics: dict[str, Any] | None, template: dict[str, Any] | None = None) -> Any:
    raw: dict[str, Any] = {"image": "img:1", "policy": {"replicas": 1}}
    if metrics is not None:
        raw["metrics"] = metrics
    if template is not None:
        raw["policy"]["template"] = template
    return parse_spec(raw)


def _worker(spec: Any) -> dict[str, Any]:
    pod = render_pod(JOB, spec, "policy", 0, epoch=0, options=RenderOptions())
    worker: dict[str, Any] = pod["spec"]["containers"][0]
    return worker


def test_a_metrics_port_reaches_the_worker_as_env_and_a_named_port() -> None:
    worker = _worker(_spec({"port": 9400}))
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert metrics_port_from_env({METRICS_PORT_ENV: env[METRICS_PORT_ENV]}) == 9400
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert ports == {"dist": 29500, "metrics": 9400}


def test_no_metrics_port_no_env_and_no_port() -> None:
    worker = _worker(_spec(None))
    assert METRICS_PORT_ENV not in {e["name"] for e in worker["env"]}
    assert [p["name"] for p in worker["ports"]] == ["dist"]


@pytest.mark.parametrize(
    ("port", "words"),
    [
        (80, "greater than or equal to 1024"),
        (70000, "less than or equal to 65535"),
        (29500, "rendezvous port"),
    ],
)
def test_a_port_that_cannot_work_is_refused_in_words(port: int, words: str) -> None:
    with pytest.raises(InvalidSpecError, match=words) as info:
        _spec({"port": port})
    assert "metrics" in str(info.value)


@pytest.mark.parametrize(("port", "ok"), [(9400, True), (29500, False)])
def test_the_crd_rule_agrees_with_the_model(port: int, ok: bool) -> None:
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    (rule,) = schema["properties"]["spec"]["properties"]["metrics"]["x-kubernetes-validations"]
    env = celpy.Environment()
    program = env.program(env.compile(rule["rule"]))
    assert bool(program.evaluate({"self": celpy.json_to_cel({"port": port})})) is ok


def test_a_template_port_on_the_metrics_port_is_a_conflict() -> None:
    template = {"spec": {"containers": [{"name": "worker", "ports": [{"containerPort": 9400}]}]}}
    with pytest.raises(TemplateConflict, match="metrics port"):
        _worker(_spec({"port": 9400}, template))
