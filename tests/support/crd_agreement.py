"""Models and CRD agreement, as data: the spec generator and :func:`run_agreement`.

Shared by ``tests/unit/test_crd_agreement.py`` and ``bench/reliability_badinput.py``.
Hypothesis draws specs from the CRD's own schema (whole specs field by field, and valid
specs changed in one or two places; each value valid, of a wrong type, out of range, or
from a pool of tricky spellings), and each spec is judged twice: by :func:`parse_spec`,
and by the generated CRD as an API server would judge it, offline
(``tests/support/crd_judge.py``: structural schema with defaulting and strict field
validation, then the CEL rules run by cel-python).

The tests check that both verdicts match.  Where the two cannot meet, the generator leaves
the case out, and :data:`NOT_GENERATED` says which and why.

Real: the models, the generated CRD, cel-python.  Nothing emulated.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tests.support.crd_judge import crd_verdict, model_verdict, re2, spec_schema

from refit_worker.contract.signals import KUBELET_STOP_SIGNALS

#: Inputs the generator never draws, each with the reason the two judges may differ on it.
NOT_GENERATED = {
    "null values": "the apiserver prunes a null in a defaulted field and then defaults it, "
    "and CEL's has() on a null field is true; the typed model reads null as absent "
    "(weights.synthetic: null) or as a wrong type.  No client writes null into a spec.",
    "whole floats in integer fields (replicas: 3.0)": "the apiserver's JSON decoding turns "
    "3.0 into the integer 3 before validation; the model, reading YAML directly in "
    "`refit run`, refuses a float with 'Input should be a valid integer'.",
    "integers outside int64": "the apiserver cannot decode them at all (a decoding error, "
    "not a validation verdict).",
    "non-string mapping keys": "JSON, and so the API, has only string keys.",
}


# -- the generator ------------------------------------------------------------------------------

_SIGNALS = sorted(
    {
        *KUBELET_STOP_SIGNALS,
        "SIGKILL",
        "SIGSTOP",
        "SIGIOT",
        "SIGCLD",
        "SIGPOLL",
        "SIGRTMIN",
        "SIGRTMAX",
    }
)
_TRICKY: dict[str, list[Any]] = {
    "signal": [
        "term",
        "Term",
        "usr1",
        "SIGBOGUS",
        "usr3",
        " usr1",
        "usr1 ",
        "SIGUSR1\n",
        "\u017figterm",
        "s\u0131gterm",
        "",
        "SIGTERMSIGTERMSIG",
        "kill",
        "9",
        "SIG",
    ],
    "bucketSize": [
        "64Mi",
        "1",
        "0",
        "0Ki",
        "1.5Ki",
        "0.5",
        "064Mi",
        "1.0",
        "64MB",
        "64mi",
        " 64Mi",
        "64Mi ",
        "64Mi\n",
        "1e3",
        "-1",
        "00",
        "1Ei",
        "9999999999Ei",
        "",
        # The bounds (issue #50): one element of the widest dtype, and 64Gi.
        "7",
        "8",
        "1Ti",
        "64Gi",
        "65Gi",
        "0064Gi",
        "68719476736",
        "68719477k",
        7,
        8,
        68719476736,
        68719476737,
    ],
    "name": ["X", "_x", "REFIT_RANK", "REFIT_", "refit_x", "REFITX", "1X", "A-B", "", "A" * 254],
    "image": ["", "img:1", " "],
    "claimName": ["", "ckpt", "c" * 254],
}
_EXTRA_KEYS = [
    "colour",
    "bucket_size",
    "grace_period_seconds",
    "max_restarts",
    "replicaz",
    "image_pull_policy",
    "create_service_account",
]
_LEAF = st.one_of(
    st.integers(-3, 3),
    st.text(max_size=3),
    st.booleans(),
    st.floats(-2.5, 2.5, allow_nan=False).filter(lambda f: f != int(f)),
)


def _wrong(kind: str | None) -> st.SearchStrategy[Any]:
    """A value of another JSON type than ``kind``."""
    options = {
        "string": st.text(max_size=4),
        "integer": st.integers(-3, 5),
        "number": st.floats(-2.5, 2.5, allow_nan=False).filter(lambda f: f != int(f)),
        "boolean": st.booleans(),
        "object": st.dictionaries(st.text(max_size=3), _LEAF, max_size=1),
        "array": st.lists(_LEAF, max_size=1),
    }
    if kind == "int-or-string":  # a float, a bool, an object or a list
        return st.one_of(options["number"], options["boolean"], options["object"], options["array"])
    others = [s for k, s in options.items() if k != kind and (k, kind) != ("integer", "number")]
    return st.one_of(others)


def _signal_spellings() -> st.SearchStrategy[str]:
    return st.sampled_from(_SIGNALS).flatmap(
        lambda n: st.sampled_from([n, n.lower(), n[3:], n[3:].lower(), n.title(), n[3:].title()])
    )


def _valid(node: dict[str, Any], key: str) -> st.SearchStrategy[Any]:
    kind = node.get("type")
    if key == "template":
        return _templates()
    if node.get("x-kubernetes-int-or-string"):
        pools = [st.integers(-2, 10), st.sampled_from(_QUANTITIES)]
        if "pattern" in node:
            pools.append(st.from_regex(re2(node["pattern"]), fullmatch=True))
        if key in _TRICKY:
            pools.append(st.sampled_from(_TRICKY[key]))
        return st.one_of(pools)
    if node.get("x-kubernetes-preserve-unknown-fields") and "properties" not in node:
        return st.dictionaries(st.text(max_size=4), _LEAF, max_size=2)
    if kind == "object" and "properties" in node:
        return _object(node)
    if kind == "object":
        return st.dictionaries(
            st.text(max_size=4), values(node["additionalProperties"], ""), max_size=2
        )
    if kind == "array":
        return st.lists(values(node["items"], key), max_size=2)
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low, high = node.get("minimum", -5), node.get("maximum", 10_000)
        return st.one_of(
            st.sampled_from([low - 1, low, low + 1, high - 1, high, high + 1]),
            st.integers(-(2**63), 2**63 - 1),
        )
    if kind == "number":
        return st.one_of(
            st.sampled_from([-1, 0, 0.0, 1e-9, 1, 2.5]), st.floats(-1e6, 1e6, allow_nan=False)
        )
    pools: list[st.SearchStrategy[Any]] = [st.text(max_size=6)]
    if "enum" in node:
        pools.append(st.sampled_from(node["enum"]))
    if "pattern" in node:
        pools.append(st.from_regex(re2(node["pattern"]), fullmatch=True))
    if key in _TRICKY:
        pools.append(st.sampled_from(_TRICKY[key]))
    if key == "signal":
        pools.append(_signal_spellings())
    return st.one_of(pools)


def values(node: dict[str, Any], key: str) -> st.SearchStrategy[Any]:
    """Mostly a value of the node's type (often valid), one time in twelve a wrong type."""
    valid = _valid(node, key)
    kind = "int-or-string" if node.get("x-kubernetes-int-or-string") else node.get("type")
    return st.integers(0, 11).flatmap(lambda n: _wrong(kind) if n == 0 else valid)


def _object(node: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    props = node["properties"]
    required = set(node.get("required", ()))
    body = st.fixed_dictionaries(
        {k: values(v, k) for k, v in props.items() if k in required},
        optional={k: values(v, k) for k, v in props.items() if k not in required},
    )

    def tweak(obj: dict[str, Any], n: int, extra: str) -> dict[str, Any]:
        if n == 0 and required:
            return {k: v for k, v in obj.items() if k not in required}
        if n == 1:
            return {**obj, extra: 1}
        return obj

    return st.builds(tweak, body, st.integers(0, 15), st.sampled_from(_EXTRA_KEYS))


#: Quantities as users write them, good and bad (resources of the short form and templates).
_QUANTITIES = ["1", "500m", "8Gi", "1.5", "1e3", "8 GB", "-1", "+2", "1Ki ", "", "lots", "0.5Gi"]

#: Valid pod templates the generator starts from (and changes in one place).
TEMPLATES: tuple[dict[str, Any], ...] = (
    {"spec": {"containers": [{"name": "worker"}]}},
    {
        "metadata": {"labels": {"team": "a"}, "annotations": {"k8s.v1.cni.cncf.io/networks": "x"}},
        "spec": {
            "imagePullSecrets": [{"name": "reg"}],
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [
                {
                    "name": "worker",
                    "env": [
                        {"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
                    ],
                    "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
                    "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "8Gi"}},
                    "ports": [{"containerPort": 8080}],
                    "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
                },
                {"name": "sidecar", "image": "busybox"},
            ],
            "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
        },
    },
)


def _template_node() -> dict[str, Any]:
    node: dict[str, Any] = spec_schema()["properties"]["policy"]["properties"]["template"]
    return node


def _templates() -> st.SearchStrategy[Any]:
    """A valid template, or one changed at one path inside it (the PodSpec is large: whole
    templates drawn field by field are almost never valid)."""
    inner = _paths(_template_node(), into_templates=True)
    change = st.sampled_from(inner).flatmap(
        lambda pn: values(pn[1], str(pn[0][-1])).map(lambda v: (pn[0], v))
    )
    changed = st.builds(
        lambda base, c: _set(copy.deepcopy(base), c[0], c[1]), st.sampled_from(TEMPLATES), change
    )
    return st.one_of(st.sampled_from(TEMPLATES), changed)


#: Valid specs that the focused generator changes in one or two places.
BASES: tuple[dict[str, Any], ...] = (
    {"image": "img"},
    {
        "image": "registry/refit:1",
        "policy": {"replicas": 2, "env": [{"name": "X", "value": "1"}], "command": ["w"]},
        "rollout": {"replicas": 3, "nodeSelector": {"a": "b"}, "tolerations": [{"k": 1}]},
        "weights": {"synthetic": {"layers": 1, "hidden": 8}},
        "transfer": {"bucketSize": "1Mi", "timeoutSeconds": 5, "backendParams": {"a": "b"}},
        "preemption": {"signal": "SIGUSR1", "injection": "stopSignal", "gracePeriodSeconds": 3},
        "failurePolicy": {"maxRestarts": 1, "backoffSeconds": 0.5},
    },
    {
        "image": "i",
        "weights": {"safetensors": {"claimName": "c"}},
        "preemption": {"signal": "usr2", "injection": "preStop"},
    },
    {
        "image": "i",
        "policy": {"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}},
        "rollout": {"template": TEMPLATES[1]},
        "gang": {"admission": "PodGroup", "podGroup": {"scheduler": "Coscheduling"}},
        "managedBy": "kueue.x-k8s.io/multikueue",
        "ttlSecondsAfterFinished": 5,
        "startDeadlineSeconds": 60,
    },
)


def _paths(
    node: dict[str, Any], path: tuple[str | int, ...] = (), *, into_templates: bool = False
) -> list[Any]:
    """(path, node) of every field below ``node``; list items at index 0, map values at 'k'.
    A pod template counts as one field unless ``into_templates``."""
    out = [(path, node)] if path else []
    if path and path[-1] == "template" and not into_templates:
        return out
    for key, child in (node.get("properties") or {}).items():
        out += _paths(child, (*path, key), into_templates=into_templates)
    if "items" in node:
        out += _paths(node["items"], (*path, 0), into_templates=into_templates)
    if isinstance(node.get("additionalProperties"), dict):
        out += _paths(node["additionalProperties"], (*path, "k"), into_templates=into_templates)
    return out


def _set(obj: Any, path: tuple[str | int, ...], value: Any) -> Any:
    """``obj`` with ``value`` at ``path`` (missing or mistyped containers made anew)."""
    if not path:
        return value
    step, rest = path[0], path[1:]
    if isinstance(step, int):
        items = list(obj) if isinstance(obj, list) and obj else [{}]
        items[0] = _set(items[0], rest, value)
        return items
    out = dict(obj) if isinstance(obj, dict) else {}
    out[step] = _set(out.get(step, {}), rest, value)
    return out


def _changes(fields: list[Any]) -> st.SearchStrategy[Any]:
    return st.sampled_from(fields).flatmap(
        lambda pn: values(pn[1], str(pn[0][-1])).map(lambda v: (pn[0], v))
    )


def _apply(base: dict[str, Any], changes: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = copy.deepcopy(base)
    for path, value in changes:
        out = _set(out, path, value)
    return out


def _focused() -> st.SearchStrategy[dict[str, Any]]:
    # policy.failurePolicy is refused whatever it holds (the rollout role's only): the
    # stream leaves it out, so that it stays balanced; test_models judges it both ways.
    fields = [pn for pn in _paths(spec_schema()) if pn[0][:2] != ("policy", "failurePolicy")]
    plain = st.builds(
        _apply,
        st.sampled_from(BASES),
        st.lists(_changes(fields), min_size=1, max_size=2),
    )
    # One change inside the template of the base that has one.
    inside = [
        (("rollout", "template", *path), node)
        for path, node in _paths(_template_node(), into_templates=True)
    ]
    templated = st.builds(
        _apply, st.just(BASES[-1]), st.lists(_changes(inside), min_size=1, max_size=1)
    )
    return st.one_of(plain, plain, templated)


#: Whole specs drawn field by field, and valid specs changed in one or two places.
specs = st.deferred(lambda: st.one_of(_object(spec_schema()), _focused()))


@dataclass
class Tally:
    """What one agreement run saw."""

    generated: int = 0
    model_valid: int = 0
    crd_valid: int = 0
    disagreements: list[tuple[Any, list[str], str | None]] = field(default_factory=list)

    @property
    def agreements(self) -> int:
        return self.generated - len(self.disagreements)


def run_agreement(examples: int) -> Tally:
    """Judge ``examples`` generated specs both ways (derandomized: the same specs each run)."""
    tally = Tally()

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(specs)
    def judge(spec: dict[str, Any]) -> None:
        crd, model = crd_verdict(spec), model_verdict(spec)
        tally.generated += 1
        tally.model_valid += model is None
        tally.crd_valid += crd == []
        if (crd == []) != (model is None):
            tally.disagreements.append((spec, crd, model))

    judge()
    return tally
