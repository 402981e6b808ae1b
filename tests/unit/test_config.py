"""The operator-worker config contract: env round-trip and errors.  Pure; nothing emulated."""

from __future__ import annotations

import pytest

from refit_worker.config import (
    ConfigError,
    RendezvousConfig,
    SafetensorsWeights,
    TransferConfig,
    WorkerConfig,
    env_name,
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


def test_env_name_of_unknown_field() -> None:
    assert env_name("signal_pid_dir") == "REFIT_SIGNAL_PID_DIR"
    with pytest.raises(KeyError):
        env_name("nope")
