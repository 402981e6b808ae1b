"""The worker's configuration: the one contract between operator and worker.

The operator renders a :class:`WorkerConfig` into a pod's environment with
:meth:`WorkerConfig.to_env`; the worker reads it back with :meth:`WorkerConfig.from_env`.
There is no other channel.  Each field becomes one ``REFIT_<FIELD>`` variable: scalars as
plain text (readable in ``kubectl describe pod``), nested models and dicts as JSON.

Fields known only once the pod exists (its uid, name, namespace) are filled by the
Kubernetes downward API; :data:`DOWNWARD_API_FIELDS` names them so the renderer can emit
``valueFrom.fieldRef`` entries instead of values.

Must not import: the operator, kubernetes, torch, nixl (the operator imports this module).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "REFIT_"

#: Exit code of a worker that stopped because of a preemption signal or notice.  The
#: operator (and the local runner) count such an exit as a preemption, not a failure.
EXIT_PREEMPTED = 83

#: Env var naming the directory (a shared emptyDir in a pod) where every process that
#: entered ``DistributedSignalHandler`` registers its pid, for the preStop delivery command.
SIGNAL_PID_DIR_ENV = "REFIT_SIGNAL_PID_DIR"

#: Env var naming the preemption signal(s) the worker listens for (comma-separated names).
PREEMPTION_SIGNAL_ENV = "REFIT_PREEMPTION_SIGNAL"

Role = Literal["policy", "rollout"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SyntheticWeights(_Frozen):
    """A deterministic, transformer-shaped state dict generated from a seed."""

    kind: Literal["synthetic"] = "synthetic"
    layers: int = Field(2, ge=1, description="Number of transformer blocks.")
    hidden: int = Field(256, ge=1, description="Hidden width.")
    vocab: int = Field(1024, ge=1, description="Embedding rows.")
    dtype: str = Field("bfloat16", description="torch dtype name of every tensor.")
    experts: int = Field(0, ge=0, description="MoE experts per layer (0: dense MLP).")
    seed: int = 0


class SafetensorsWeights(_Frozen):
    """All ``*.safetensors`` files of a directory on a mounted volume."""

    kind: Literal["safetensors"] = "safetensors"
    path: str = Field(min_length=1)


WeightsSource = SyntheticWeights | SafetensorsWeights


class TransferConfig(_Frozen):
    """How weights move: the NIXL backend and the bucket engine's knobs."""

    backend: str = "UCX"
    backend_params: dict[str, str] = Field(default_factory=dict)
    bucket_size: int = Field(64 << 20, gt=0, description="Bytes per transfer bucket.")
    device: Literal["cpu", "cuda"] = "cpu"
    shard_expert_weights: bool = False
    release_after_refit: bool = False
    timeout_seconds: float = Field(120.0, gt=0)
    refits: int = Field(3, ge=1, description="Refits to run before the job is done.")
    checksum: bool = True


class RendezvousConfig(_Frozen):
    """Where ranks publish and find each other (see ``refit_worker.rendezvous``)."""

    store: Literal["configmap", "file"] = "configmap"
    #: ConfigMap name (store=configmap) or directory (store=file).
    location: str = Field(min_length=1)
    shards: int = Field(1, ge=1)


class WorkerConfig(_Frozen):
    """Everything a policy or rollout worker needs to know, set per pod by the operator."""

    job: str = Field(min_length=1)
    namespace: str = "default"
    role: Role
    rank: int = Field(ge=0)
    policy_world_size: int = Field(ge=1)
    rollout_world_size: int = Field(ge=1)
    epoch: int = Field(0, ge=0)
    #: Refits every rollout rank committed in earlier epochs: a recreated gang resumes here.
    first_refit: int = Field(0, ge=0)
    pod_name: str = ""
    pod_uid: str = ""
    #: torch.distributed rendezvous inside the role (rank 0 of the role, via its Service).
    master_addr: str = "127.0.0.1"
    master_port: int = Field(29500, ge=1, le=65535)
    weights: WeightsSource = Field(default_factory=SyntheticWeights, discriminator="kind")
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    rendezvous: RendezvousConfig
    preemption_signal: str = "SIGTERM"
    signal_pid_dir: str = ""

    @property
    def world_size(self) -> int:
        """Ranks in this worker's own role."""
        return self.policy_world_size if self.role == "policy" else self.rollout_world_size

    def to_env(self) -> dict[str, str]:
        """Render as ``REFIT_*`` environment variables (plain text or JSON per field)."""
        env: dict[str, str] = {}
        for name, value in self.model_dump(mode="json").items():
            if isinstance(value, dict | list):
                env[_env_name(name)] = json.dumps(value, sort_keys=True, separators=(",", ":"))
            elif isinstance(value, bool):
                env[_env_name(name)] = "true" if value else "false"
            else:
                env[_env_name(name)] = str(value)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerConfig:
        """Read the config from ``environ`` (default ``os.environ``).

        Raises :class:`ConfigError` naming every missing or invalid variable.
        """
        environ = os.environ if environ is None else environ
        raw: dict[str, Any] = {}
        for name, field in cls.model_fields.items():
            key = _env_name(name)
            if key not in environ:
                continue
            text = environ[key]
            annotation = str(field.annotation)
            nested = any(t in annotation for t in ("Config", "Weights", "dict"))
            if nested:
                try:
                    raw[name] = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{key} is not valid JSON: {exc}") from exc
            else:
                raw[name] = text
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{_env_name(str(err['loc'][0]))}"
                f"{'.' + '.'.join(map(str, err['loc'][1:])) if len(err['loc']) > 1 else ''}:"
                f" {err['msg']}"
                for err in exc.errors()
            )
            raise ConfigError(f"invalid worker environment: {problems}") from exc


#: Config fields whose values the pod gets from the downward API (field -> fieldPath).
DOWNWARD_API_FIELDS: dict[str, str] = {
    "pod_name": "metadata.name",
    "pod_uid": "metadata.uid",
    "namespace": "metadata.namespace",
}


class ConfigError(ValueError):
    """The environment does not hold a valid worker configuration."""


def _env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def env_name(field: str) -> str:
    """The environment variable that carries config field ``field``."""
    if field not in WorkerConfig.model_fields:
        raise KeyError(f"WorkerConfig has no field {field!r}")
    return _env_name(field)
