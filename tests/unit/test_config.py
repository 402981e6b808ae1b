"""The operator-worker config contract: env round-trip, parsed signals, errors.  Pure."""

from __future__ import annotations

import re
import signal

import pytest
from pydantic import ValidationError

from refit_worker.contract.config import (
    _JSON_FIELDS,
    ConfigError,
    RendezvousConfig,
    SafetensorsWeights,
    SyntheticWeights,
    TransferConfig,
    WorkerConfig,
    env_name,
)
from refit_worker.contract.dtypes import SYNTHETIC_DTYPE_NAMES, WIRE_DTYPE_NAMES
from refit_worker.contract.env import (
    ENV_PREFIX,
    PREEMPTION_SIGNAL_ENV,
    SIGNAL_PID_DIR_ENV,
    Preemption,
)


def _config(**overrides: object) -> WorkerConfig:
    base: dict[str, object] = {
        "job": "demo",
        "role": "rollout",
        "rank": 2,
        "policy_world_size": 2,
        "rollout_world_size": 3,
        "rendezvous": RendezvousConfig(store="file", location="/tmp/rdzv"),
    }
    base.update(overrides)
    return WorkerConfig.model_validate(base)


@pytest.mark.parametrize(
    "config",
    [
        _config(),
        _config(weights=SafetensorsWeights(path="/models/llama")),
        _config(transfer=TransferConfig(bucket_size=1 << 20, backend_params={"num_workers": "2"})),
    ],
)
def test_env_round_trip(config: WorkerConfig) -> None:
    env = config.to_env()
    assert all(key.startswith("REFIT_") and isinstance(v, str) for key, v in env.items())
    assert WorkerConfig.from_env(env) == config


def test_world_size_follows_role() -> None:
    assert _config(role="rollout").world_size == 3
    assert _config(role="policy").world_size == 2


def test_missing_and_invalid_variables_are_named() -> None:
    env = _config().to_env()
    del env["REFIT_JOB"]
    env["REFIT_RANK"] = "minus one"
    with pytest.raises(ConfigError) as err:
        WorkerConfig.from_env(env)
    assert "REFIT_JOB" in str(err.value)
    assert "REFIT_RANK" in str(err.value)


def test_bad_json_is_named() -> None:
    env = _config().to_env()
    env["REFIT_TRANSFER"] = "{not json"
    with pytest.raises(ConfigError, match="REFIT_TRANSFER is not valid JSON"):
        WorkerConfig.from_env(env)


def test_zero_bucket_size_rejected() -> None:
    env = _config().to_env()
    env["REFIT_TRANSFER"] = '{"bucket_size": 0}'
    with pytest.raises(ConfigError, match=r"REFIT_TRANSFER\.bucket_size"):
        WorkerConfig.from_env(env)


@pytest.mark.parametrize(
    ("transfer", "weights", "named"),
    [
        ('{"bucket_size": 1}', None, "REFIT_TRANSFER.bucket_size"),
        ('{"bucket_size": 1099511627776}', None, "REFIT_TRANSFER.bucket_size"),
        ('{"timeout_seconds": 1e308}', None, "REFIT_TRANSFER.timeout_seconds"),
        ('{"refits": 1000001}', None, "REFIT_TRANSFER.refits"),
        (None, '{"kind": "synthetic", "layers": 1000000000000}', "REFIT_WEIGHTS.synthetic.layers"),
        (None, '{"kind": "synthetic", "experts": 1025}', "REFIT_WEIGHTS.synthetic.experts"),
    ],
)
def test_a_worker_refuses_what_the_api_refuses_naming_the_variable(
    transfer: str | None, weights: str | None, named: str
) -> None:
    """The bounds are the contract's (issue #50): a pod whose env slipped past the API
    (an older CRD, a hand-made pod) exits EXIT_BAD_CONFIG at start, not retryable."""
    env = _config().to_env()
    if transfer is not None:
        env["REFIT_TRANSFER"] = transfer
    if weights is not None:
        env["REFIT_WEIGHTS"] = weights
    with pytest.raises(ConfigError, match=re.escape(named)):
        WorkerConfig.from_env(env)


def test_env_name_of_unknown_field() -> None:
    assert env_name("signal_pid_dir") == "REFIT_SIGNAL_PID_DIR"
    with pytest.raises(KeyError):
        env_name("nope")


def test_signals_arrive_parsed_and_render_as_names() -> None:
    env = _config().to_env()
    assert env["REFIT_PREEMPTION_SIGNAL"] == "SIGTERM"  # the default
    env["REFIT_PREEMPTION_SIGNAL"] = " usr1 , sigterm"
    config = WorkerConfig.from_env(env)
    assert config.preemption_signal == (signal.SIGUSR1, signal.SIGTERM)
    assert config.to_env()["REFIT_PREEMPTION_SIGNAL"] == "SIGUSR1,SIGTERM"
    assert WorkerConfig.from_env(config.to_env()) == config


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("SIGBOGUS", "Unknown signal name 'SIGBOGUS'"),
        ("KILL", "signal 'KILL' cannot be caught"),
        ("usr1,USR1", "SIGUSR1 given more than once"),
        ("usr1,", "empty signal name"),
        ("", "empty signal name"),
    ],
)
def test_a_bad_signal_fails_from_env_naming_the_variable(text: str, message: str) -> None:
    env = _config().to_env()
    env["REFIT_PREEMPTION_SIGNAL"] = text
    with pytest.raises(ConfigError, match="REFIT_PREEMPTION_SIGNAL") as err:
        WorkerConfig.from_env(env)
    assert message in str(err.value)


def test_json_fields_are_exactly_the_nested_ones() -> None:
    dumped = _config().model_dump(mode="json")
    assert {name for name, v in dumped.items() if isinstance(v, dict | list)} == _JSON_FIELDS


def test_the_stdlib_readers_use_the_configs_env_names() -> None:
    # refit-signal and Preemption.from_env read these without loading WorkerConfig.
    assert env_name("preemption_signal") == PREEMPTION_SIGNAL_ENV
    assert env_name("signal_pid_dir") == SIGNAL_PID_DIR_ENV
    assert all(name.startswith(ENV_PREFIX) for name in _config().to_env())


def test_preemption_from_env() -> None:
    assert Preemption.from_env({}) == Preemption((signal.SIGTERM,), "")
    env = {PREEMPTION_SIGNAL_ENV: "USR2, term", SIGNAL_PID_DIR_ENV: "/var/run/refit"}
    assert Preemption.from_env(env) == Preemption(
        (signal.SIGUSR2, signal.SIGTERM), "/var/run/refit"
    )
    with pytest.raises(ValueError, match=f"{PREEMPTION_SIGNAL_ENV}: Unknown signal name 'NOPE'"):
        Preemption.from_env({PREEMPTION_SIGNAL_ENV: "NOPE"})


def test_synthetic_dtypes_are_names_the_wire_carries() -> None:
    assert set(SYNTHETIC_DTYPE_NAMES) <= set(WIRE_DTYPE_NAMES)
    assert "float64" in WIRE_DTYPE_NAMES and "float64" not in SYNTHETIC_DTYPE_NAMES
    with pytest.raises(ValidationError, match="dtype"):
        SyntheticWeights(dtype="float64")  # type: ignore[arg-type]


def test_outside_a_pod_one_sentence_says_where_a_worker_runs() -> None:
    """No REFIT_* at all: not six missing variables under pydantic's report, but where."""
    with pytest.raises(ConfigError) as err:
        WorkerConfig.from_env({"HOME": "/root", "PATH": "/usr/bin"})
    message = str(err.value)
    assert "\n" not in message and "inside a RefitJob pod" in message
    assert "`refit run job.yaml`" in message and "spec.policy.command" in message
    assert err.value.__cause__ is None and err.value.__context__ is None


def test_a_partial_environment_is_named_without_pydantics_report() -> None:
    env = _config().to_env()
    del env["REFIT_JOB"]
    with pytest.raises(ConfigError) as err:
        WorkerConfig.from_env(env)
    assert "REFIT_JOB" in str(err.value) and err.value.__suppress_context__
