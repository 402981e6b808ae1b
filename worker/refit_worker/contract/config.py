"""The worker's configuration: the one channel from operator to worker.

The operator renders a :class:`WorkerConfig` into a pod's environment with
:meth:`WorkerConfig.to_env`; the worker reads it back with :meth:`WorkerConfig.from_env`.
There is no other channel.  Each field becomes one ``REFIT_<FIELD>`` variable: scalars as
plain text (readable in ``kubectl describe pod``), nested models and dicts as JSON.  Values
arrive parsed: ``preemption_signal`` is a tuple of ``signal.Signals``, so a bad signal name
fails :meth:`~WorkerConfig.from_env` (exit 2) before the worker joins anything.

Fields known only once the pod exists (its uid, name, namespace) are filled by the
Kubernetes downward API; :data:`DOWNWARD_API_FIELDS` names them so the renderer can emit
``valueFrom.fieldRef`` entries instead of values.

:class:`TransferKnobs` are the transfer settings a RefitJob spec and the worker share; the
spec's ``TransferSpec`` and this module's :class:`TransferConfig` both extend it.
"""

from __future__ import annotations

import base64
import json
import os
import signal
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
)

from refit_worker.contract.adapters import AdapterKnobs
from refit_worker.contract.bounds import (
    MAX_BUCKET_BYTES,
    MAX_EXPERTS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_REFITS,
    MAX_VOCAB,
    MAX_WAIT_SECONDS,
    MIN_BUCKET_BYTES,
)
from refit_worker.contract.dtypes import SyntheticDtype
from refit_worker.contract.entries import MAX_GENERATION
from refit_worker.contract.env import DEFAULT_SIGNALS, ENV_PREFIX
from refit_worker.contract.roles import Role
from refit_worker.contract.signals import parse_signal_list, parse_signals, signal_list_text


def _signals_in(value: object) -> object:
    # The env form ("SIGUSR1,SIGTERM") or a sequence: both through the one parser.
    if isinstance(value, str):
        return parse_signal_list(value)
    if isinstance(value, list | tuple):
        return parse_signals(value)
    return value


#: One or more preemption signals; plain text ``SIGUSR1,SIGTERM`` in the environment.
PreemptionSignals = Annotated[
    tuple[signal.Signals, ...],
    BeforeValidator(_signals_in),
    PlainSerializer(signal_list_text, return_type=str),
]


def _key_text(value: object) -> object:
    # An Ed25519 key (seed or public) is 32 bytes: base64 of that, or "" for none.  The
    # message never quotes the value: it may be the private key.
    if not isinstance(value, str) or not value.strip():
        return "" if value is None else value
    try:
        raw = base64.b64decode(value.strip().encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ValueError("not base64 text of an Ed25519 key") from None
    if len(raw) != 32:
        raise ValueError(f"{len(raw)} bytes of key, an Ed25519 key has 32")
    return value.strip()


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SyntheticWeights(_Frozen):
    """A deterministic, transformer-shaped state dict generated from a seed."""

    kind: Literal["synthetic"] = "synthetic"
    layers: int = Field(
        2, ge=1, le=MAX_LAYERS, description=f"Number of transformer blocks (at most {MAX_LAYERS})."
    )
    hidden: int = Field(
        256, ge=1, le=MAX_HIDDEN, description=f"Hidden width (at most {MAX_HIDDEN})."
    )
    vocab: int = Field(
        1024, ge=1, le=MAX_VOCAB, description=f"Embedding rows (at most {MAX_VOCAB})."
    )
    dtype: SyntheticDtype = Field("bfloat16", description="torch dtype name of every tensor.")
    experts: int = Field(
        0,
        ge=0,
        le=MAX_EXPERTS,
        description=f"MoE experts per layer (0: dense MLP; at most {MAX_EXPERTS}).",
    )
    seed: int = 0
    # None, not 0: an unset field stays out of the spec digest (render.spec_hash), so
    # adding it recreates no running job's pods.
    pace: float | None = Field(
        None,
        ge=0,
        le=3600,
        description=(
            "Seconds the demo trainer spends on each training step before its refit, a "
            "stand-in for a real step, so refits come at an RL job's pace (unset or 0: "
            "back to back)."
        ),
    )
    changes: float | None = Field(
        None,
        gt=0,
        le=1,
        description=(
            "Share of each tensor's elements a training step changes, spread evenly over "
            "it, as a real optimiser step on bf16 weights leaves most elements as they were "
            "(unset: every element changes). What makes a delta refit worth sending."
        ),
    )
    lockstep: bool | None = Field(
        None,
        description=(
            "The demo trainer starts each training step only once every rollout slot "
            "serves the last refit (a replacement too: seeded or sent it first), as a "
            "synchronous on-policy RL loop trains on rollouts of the weights it just sent; "
            "each wait is bounded by transfer.timeoutSeconds (unset or false: it does not "
            "wait)."
        ),
    )


class SafetensorsWeights(_Frozen):
    """All ``*.safetensors`` files of a directory on a mounted volume."""

    kind: Literal["safetensors"] = "safetensors"
    path: str = Field(min_length=1)


WeightsSource = SyntheticWeights | SafetensorsWeights


class TransferKnobs(_Frozen):
    """NIXL transfer knobs, the same in a RefitJob's spec and in the worker's config.

    The bucket size is not here: the spec writes it as a Kubernetes quantity (``64Mi``),
    the worker gets it in bytes.
    """

    backend: str = Field("UCX", min_length=1)
    backend_params: dict[str, str] = Field(default_factory=dict)
    device: Literal["cpu", "cuda"] = "cpu"
    shard_expert_weights: bool = False
    release_after_refit: bool = False
    # None, not "off": an unset field stays out of the spec digest (render.spec_hash).
    delta: Literal["off", "on", "auto"] | None = Field(
        None,
        description=(
            "on: the policy sends each refit as the elements that changed since the last "
            "one, when that is at most half the bytes (sharded FSDP2/TP ranks each send the "
            "changes of their own blocks); a replica applies it onto a copy of the version "
            "it serves and commits only if the result's whole-state digest is the trainer's. "
            "A replica that lacks that version gets the refit whole. Costs each policy rank "
            "one more copy of its weights and a few passes over them per refit. auto: as "
            "on, but only while the "
            "last delta refit took less time than the last whole one (tried again every 8 "
            "refits): finding and applying the changes can cost more than a fast link "
            "saves. off (or unset): every refit is sent whole."
        ),
    )
    adapter: AdapterKnobs | None = Field(
        None,
        description=(
            "Set: each refit is a PEFT LoRA adapter's tensors (rank, alpha and target modules, "
            "the base model's identity and digest in its header), served by the rollout as a "
            "new adapter <name>-v<refit>; a rollout serving another base refuses it. Unset: "
            "refits carry whole weights."
        ),
    )
    timeout_seconds: float = Field(
        120.0,
        gt=0,
        le=MAX_WAIT_SECONDS,
        description=f"Seconds one wait for a peer or a transfer may take (at most"
        f" {MAX_WAIT_SECONDS}: a day).",
    )
    refits: int = Field(
        3,
        ge=1,
        le=MAX_REFITS,
        description=f"Refits before the job is done (at most {MAX_REFITS}).",
    )

    def knobs(self) -> dict[str, Any]:
        """The shared knobs alone, by field name (to build the other side's model)."""
        return {name: getattr(self, name) for name in TransferKnobs.model_fields}


class TransferConfig(TransferKnobs):
    """How weights move in the worker: the shared knobs, bytes per bucket, checksums."""

    bucket_size: int = Field(
        64 << 20,
        ge=MIN_BUCKET_BYTES,
        le=MAX_BUCKET_BYTES,
        description="Bytes per transfer bucket (each rank allocates two in full).",
    )
    checksum: bool = True


class RendezvousConfig(_Frozen):
    """Where ranks publish and find each other (see ``refit_worker.rendezvous``)."""

    store: Literal["configmap", "file"] = "configmap"
    #: ConfigMap name (store=configmap) or directory (store=file).
    location: str = Field(min_length=1)
    shards: int = Field(1, ge=1)


#: The kubelet's default ``terminationMessagePath``.
TERMINATION_MESSAGE_PATH = "/dev/termination-log"


class WorkerConfig(_Frozen):
    """Everything a policy or rollout worker needs to know, set per pod by the operator."""

    job: str = Field(min_length=1)
    namespace: str = "default"
    role: Role
    rank: int = Field(ge=0)
    policy_world_size: int = Field(ge=1)
    rollout_world_size: int = Field(ge=1)
    epoch: int = Field(0, ge=0)
    #: The rollout replica's generation (``REFIT_GENERATION``): a replacement of a rank
    #: has a higher one than the pod it replaces; 0 for policy ranks.
    generation: int = Field(0, ge=0, le=MAX_GENERATION)
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
    #: The signal(s) the worker listens for (``REFIT_PREEMPTION_SIGNAL``, comma-separated).
    preemption_signal: PreemptionSignals = DEFAULT_SIGNALS
    #: Where ``DistributedSignalHandler`` registers for ``refit-signal`` ("" for nowhere).
    signal_pid_dir: str = ""
    #: Where a failing worker writes why (the container's ``terminationMessagePath``): the
    #: kubelet puts it into the pod's status, and the operator into the job's.
    termination_message_path: str = TERMINATION_MESSAGE_PATH
    #: A rollout rank stopped by its pod's stop signal (a drain, an eviction) stays up to
    #: this long, offering its last committed refit, until its replacement serves; the
    #: operator sets it well inside the pod's grace period.  0: it exits at once.
    hand_over_seconds: float = Field(0.0, ge=0, le=3600)
    #: The job's private signing key (base64 of an Ed25519 seed), in policy pods only: the
    #: operator has the kubelet read it from the job's Secret.  Every refit this rank sends
    #: is sealed with it.  "": refits go unsigned.  Never printed (``repr=False``).
    signing_key: Annotated[str, BeforeValidator(_key_text)] = Field("", repr=False)
    #: The job's public key (base64), in rollout pods: a refit, delta or seed not sealed with
    #: it is refused.  "": refits are taken unsigned.
    verify_key: Annotated[str, BeforeValidator(_key_text)] = ""

    @property
    def world_size(self) -> int:
        """Ranks in this worker's own role."""
        return self.policy_world_size if self.role == "policy" else self.rollout_world_size

    def to_env(self) -> dict[str, str]:
        """Render as ``REFIT_*`` environment variables (plain text or JSON per field)."""
        env: dict[str, str] = {}
        # An unset optional setting of a nested model stays out, so a worker of the
        # previous version (extra="forbid") still reads the pods of a newer operator.
        nested = self.model_dump(mode="json", exclude_none=True)
        for name, dumped in self.model_dump(mode="json").items():
            if name in KEY_FIELDS and not dumped:
                continue  # no key: the variable stays out (a pod gets it from a Secret)
            value = nested[name] if isinstance(dumped, dict) else dumped
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
        if not any(_env_name(name) in environ for name in cls.model_fields):
            raise ConfigError(NO_WORKER_ENV)
        raw: dict[str, Any] = {}
        for name in cls.model_fields:
            key = _env_name(name)
            if key not in environ:
                continue
            text = environ[key]
            if name in _JSON_FIELDS:
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
            # The sentence names every variable; pydantic's own report would only repeat it.
            raise ConfigError(f"invalid worker environment: {problems}") from None


#: Fields carried as JSON (models and dicts); every other field is plain text.
_JSON_FIELDS = frozenset({"weights", "transfer", "rendezvous"})

#: Config fields that hold the job's key halves: rendered from the job's Secret, never as
#: values (field -> the Secret's data key).
KEY_FIELDS: dict[str, str] = {"signing_key": "ed25519.key", "verify_key": "ed25519.pub"}

#: Config fields whose values the pod gets from the downward API (field -> fieldPath).
DOWNWARD_API_FIELDS: dict[str, str] = {
    "pod_name": "metadata.name",
    "pod_uid": "metadata.uid",
    "namespace": "metadata.namespace",
}


class ConfigError(ValueError):
    """The environment does not hold a valid worker configuration."""


#: What a process started outside a RefitJob pod is told (no REFIT_* variable at all).
NO_WORKER_ENV = (
    f"no {ENV_PREFIX}* worker environment in this process: a worker (RefitSession.from_env(),"
    " refit-worker) runs inside a RefitJob pod, whose env the operator renders, or under"
    " `refit run job.yaml` with your program as spec.policy.command / spec.rollout.command"
)


def _env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def env_name(field: str) -> str:
    """The environment variable that carries config field ``field``."""
    if field not in WorkerConfig.model_fields:
        raise KeyError(f"WorkerConfig has no field {field!r}")
    return _env_name(field)
