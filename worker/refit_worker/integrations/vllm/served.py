"""What a vLLM worker serves after a landing: redo its one-time processing, then prove it.

vLLM 0.32's in-place reload (``initialize_layerwise_reload`` / ``model.load_weights`` /
``finalize_layerwise_reload``) re-runs each layer's ``quant_method.
process_weights_after_loading`` only for layers that received a tensor, and the CPU MoE
method skips its expert prepacking on every call after the first.  Two derived states go
stale on the CPU build (read from its source): a tied ``lm_head`` (it shares
``embed_tokens.weight``, never receives a tensor of its own, and keeps the oneDNN handle
packed from the *initial* embedding), and the fused experts (the reload leaves the raw
``w13``/``w2`` layout where the kernel reads a prepacked one).  :func:`redo_processing`
redoes exactly those steps with vLLM's own methods after every landing, for the modules
that landing rebuilt (a delta's landing reloads only the modules its changes feed:
:func:`landing_for`, :mod:`.served_modules`).

:func:`check_served` then reads the served state back through the engine's own kernels:
for every layer that holds parameters, the tensors it should hold are built from the
received HF tensors with the model's own name mapping (``hf_to_vllm_mapper``: renames and
the stacking of q/k/v and gate/up, in shard order; tied weights by parameter identity),
and

- a linear layer (``LinearBase``) and an LM head: ``quant_method.apply`` on a fixed
  probe input (what the engine computes with, prepacked or not) against ``x @ W.T + b``;
- an embedding: ``quant_method.embedding`` of probe ids against the expected rows;
- the fused experts of an MoE layer (``RoutedExperts``, unquantized, gated SiLU, no
  expert parallelism): ``forward_modular`` (what the layer's runner calls after routing:
  the quant method's kernel on the prepacked ``w13`` / ``w2``) on a fixed probe routed to
  each expert in turn, against the same computed in plain torch from the sent per-expert
  tensors (:mod:`.served_experts`); a difference names the expert;
- any other layer whose parameters are plain (norms): the parameter itself;
- a layer it cannot read back (quantized or biased experts, a monolithic MoE kernel, any
  other layer with a quant method) is named in ``unprobed``: the level stays below
  ``served-params`` unless nothing is.

Tensor-parallel workers hold parts: above one rank, ``weights`` are the parts this
worker received (:mod:`.served_shards` declared them from vLLM's own layers), so the same
checks read each layer's local part back through the worker's own kernels (a row-parallel
layer's local product before its reduction, the local vocabulary rows, the fused
experts' local intermediate rows); a layer whose part was not described is ``unprobed``.

Runs inside a vLLM process; vLLM is imported inside its functions, not at module import.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_worker.integrations.vllm.served_experts import (
    ExpertNames,
    expert_problems,
    expert_weights,
    probe_routing,
    reference_moe,
)
from refit_worker.integrations.vllm.served_modules import (
    LandingSet,
    ServedName,
    landing_set,
    within,
)

#: Largest relative error (max |live - expected| / max |expected|) accepted per dtype:
#: oneDNN and torch accumulate in different orders; a stale or skipped tensor is off by
#: the order of the weights themselves.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}
PROBE_ROWS = 4
_SHARD_ORDER = {"q": 0, "k": 1, "v": 2}


@dataclass
class ServedReport:
    """The outcome of :func:`check_served`."""

    probed: list[str] = field(default_factory=list)
    #: ``"<tensor>: <why>"`` for every served tensor that differs from what was sent.
    mismatches: list[str] = field(default_factory=list)
    #: Layers whose served state could not be read back (so not proven).
    unprobed: list[str] = field(default_factory=list)


@torch.no_grad()
def redo_processing(model: torch.nn.Module, reloaded: Collection[str] | None = None) -> list[str]:
    """Redo the one-time post-load steps vLLM's reload leaves stale; the layers redone.

    ``reloaded``: the modules the landing reloaded (:mod:`.served_modules`), whose steps
    alone are redone: a module the reload did not rebuild still holds its processed
    state, and processing that twice breaks it (the CPU experts' prepack).  None: the
    landing reloaded every tensor."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    holder = {
        id(p): name
        for name, m in model.named_modules()
        if not isinstance(m, ParallelLMHead)
        for p in m.parameters(recurse=False)
    }

    def rebuilt(name: str) -> bool:
        return reloaded is None or within(name, reloaded)

    done = []
    for name, module in model.named_modules():
        method: Any = getattr(module, "quant_method", None)
        own = list(module.parameters(recurse=False))
        if (
            isinstance(module, ParallelLMHead)
            and own
            and all(id(p) in holder and rebuilt(holder[id(p)]) for p in own)
        ):
            # Tied: its weight is another layer's, reloaded there; its kernel's handle is not.
            method.process_weights_after_loading(module)
            done.append(name)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(module, "w13_weight") and rebuilt(name):
            # What `_setup_kernel` does only at first load (the CPU prepack, for one).
            experts.process_weights_after_loading(module)
            done.append(name)
    return done


def served_name(model: torch.nn.Module) -> ServedName:
    """The model's own checkpoint-name -> parameter-name mapping (identity without one)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return lambda name: name
    return mapper.map_name  # type: ignore[no-any-return]


def landing_for(
    model: torch.nn.Module, names: Collection[str], changed: Collection[str]
) -> LandingSet:
    """The checkpoint tensors to reload so that ``changed`` lands in whole modules."""
    modules = {name for name, _ in model.named_modules() if name}
    return landing_set(names, changed, served_name(model), modules)


def shard_index(hf_name: str, stacked: Mapping[str, tuple[str, Any]]) -> int:
    """Which part of its stacked parameter ``hf_name`` is (0 when it is not stacked)."""
    shard = None
    for substr, (_, shard_id) in stacked.items():
        if substr in hf_name:
            shard = shard_id
    if isinstance(shard, int):
        return shard
    return _SHARD_ORDER.get(str(shard), 0)


def _whole(parts: list[torch.Tensor]) -> torch.Tensor:
    """A parameter from its parts: the one part itself, or the stacked parts joined."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


class ExpectedParams(Mapping[str, torch.Tensor]):
    """vLLM parameter name -> the tensor it should hold (full, unpadded).  A stacked
    parameter's parts (:attr:`parts`, in shard order) are joined only when the whole is
    asked for: the linear check reads them one by one, so no copy of a stacked weight is
    made (the read-back's cost is the passes it makes over the weights)."""

    def __init__(self, parts: dict[str, list[torch.Tensor]]) -> None:
        self.parts = parts
        self._joined: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._joined:
            self._joined[name] = _whole(self.parts[name])
        return self._joined[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)


def expected_params(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> ExpectedParams:
    """What each vLLM parameter should hold, built from the HF tensors with the model's
    own mapping; stacked parts in shard order."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    stacked: Mapping[str, tuple[str, Any]] = getattr(mapper, "orig_to_new_stacked", {})
    to_served = served_name(model)
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for hf_name, tensor in weights.items():
        name = to_served(hf_name)
        if name is not None:
            parts.setdefault(name, []).append((shard_index(hf_name, stacked), tensor))
    return ExpectedParams(
        {name: [t for _, t in sorted(got, key=lambda kt: kt[0])] for name, got in parts.items()}
    )


def _relative_error(live: torch.Tensor, expected: torch.Tensor) -> float:
    live, expected = live.float(), expected.float()
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    return float((live - expected).abs().max()) / max(scale, 1e-6) if live.numel() else 0.0


def differs(live: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why ``live`` is not ``expected`` within :data:`TOLERANCE` for ``dtype`` (None: it is)."""
    if tuple(live.shape) != tuple(expected.shape):
        return f"shape {tuple(live.shape)}, expected {tuple(expected.shape)}"
    if live.dtype == expected.dtype and torch.equal(live, expected):
        return None  # one pass, no float copies: what an unquantized layer serves
    error = _relative_error(live, expected)
    limit = TOLERANCE.get(dtype, 5e-2)
    return None if error <= limit else f"relative error {error:.3g} > {limit:g}"


def _probe(rows: int, columns: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows * 7919 + columns)
    return torch.randn(rows, columns, generator=generator).to(dtype=dtype, device=device)


def _own_expected(
    module_name: str,
    module: torch.nn.Module,
    expected: ExpectedParams,
    owner: Mapping[int, str],
) -> dict[str, list[torch.Tensor] | None]:
    """Each direct parameter's expected parts (tied ones through their owner's name)."""
    out: dict[str, list[torch.Tensor] | None] = {}
    for attr, param in module.named_parameters(recurse=False):
        full = f"{module_name}.{attr}" if module_name else attr
        name = full if full in expected.parts else owner.get(id(param), full)
        out[attr] = expected.parts.get(name)
    return out


def _check_linear(module: Any, want: Mapping[str, list[torch.Tensor] | None]) -> str | None:
    weight, bias = want.get("weight"), want.get("bias")
    if weight is None or ("bias" in want and bias is None):
        return "no tensor was sent for it"
    dtype = weight[0].dtype
    x = _probe(PROBE_ROWS, weight[0].shape[1], dtype, weight[0].device)
    live = module.quant_method.apply(module, x, getattr(module, "bias", None))
    # Each sent part read once, in its own dtype: no joined or float copy of the weight.
    reference = torch.cat([torch.nn.functional.linear(x, part) for part in weight], dim=1)
    reference = reference.float()
    if bias is not None:
        reference += _whole(bias).float()
    return differs(live[:, : reference.shape[1]], reference, dtype)


#: Bytes of embedding rows gathered through the kernel at a time: the compare reads them
#: while they are in cache, so the table is read once, not copied whole first.
EMBEDDING_CHUNK_BYTES = 1 << 20


def _check_embedding(module: Any, want: Mapping[str, list[torch.Tensor] | None]) -> str | None:
    parts = want.get("weight")
    if parts is None:
        return "no tensor was sent for it"
    weight = _whole(parts)
    rows = weight.shape[0]
    step = max(1, EMBEDDING_CHUNK_BYTES // max(1, weight[0].numel() * weight.element_size()))
    for start in range(0, rows, step):
        ids = torch.arange(start, min(start + step, rows), device=weight.device)
        live = module.quant_method.embedding(module, ids)
        problem = differs(live, weight[start : start + step], weight.dtype)
        if problem is not None:
            return f"rows {start}..{start + len(ids) - 1}: {problem}"
    return None


def _check_plain(module: Any, want: Mapping[str, list[torch.Tensor] | None]) -> str | None:
    for attr, parts in want.items():
        if parts is None:
            return f"no tensor was sent for {attr!r}"
        tensor = _whole(parts)
        problem = differs(getattr(module, attr), tensor, tensor.dtype)
        if problem is not None:
            return f"{attr}: {problem}"
    return None


def _kind(module: torch.nn.Module) -> str | None:
    """How :func:`check_served` reads ``module`` back; None: it cannot."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    if isinstance(module, LinearBase | ParallelLMHead):
        return "linear"
    if isinstance(module, VocabParallelEmbedding):
        return "embedding"
    if readable_experts(module):
        return "experts"
    return "plain" if getattr(module, "quant_method", None) is None else None


def readable_experts(module: Any) -> bool:
    """Whether ``module`` is a fused-experts layer that :func:`_check_experts` reproduces:
    unquantized, modular kernel, gated SiLU, no biases, every expert local."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    if not isinstance(module, RoutedExperts):
        return False
    method, config = module.quant_method, module.moe_config
    return (
        isinstance(method, UnquantizedFusedMoEMethod)
        and not method.is_monolithic
        and module.expert_map is None
        and config.is_act_and_mul
        and module.activation.value == "silu"
        and module.swiglu_limit is None
        and not config.has_bias
    )


def _check_experts(module: Any, expected: Mapping[str, torch.Tensor]) -> list[str]:
    """The experts' served kernel on a probe routed to each expert, against plain torch
    on the sent tensors; one problem per expert that differs (named by its tensors)."""
    names = ExpertNames(
        module.layer_name,
        module.ckpt_gate_proj_name,
        module.ckpt_up_proj_name,
        module.ckpt_down_proj_name,
    )
    sent = expert_weights(expected, names, module.global_num_experts)
    if isinstance(sent, str):
        return [f"{module.layer_name}: {sent}"]
    w13, w2 = sent
    dtype, hidden = module.params_dtype, w13.shape[-1]
    device = module.w13_weight.device
    routing = probe_routing(module.global_num_experts, PROBE_ROWS, device)
    x = _probe(len(routing[1]), hidden, dtype, device)
    # The kernel may run on a hidden size vLLM padded: zero columns beyond the model's.
    padded = torch.nn.functional.pad(x, (0, int(module.hidden_size) - hidden))
    live = module.forward_modular(padded, *routing)
    if not isinstance(live, torch.Tensor):
        return [f"{module.layer_name}: the kernel deferred its output ({type(live).__name__})"]
    reference = reference_moe(x, w13, w2, routing, bool(module.apply_router_weight_on_input))
    return expert_problems(
        live[:, :hidden], reference, routing[1], names, differs=differs, dtype=dtype
    )


def _layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The layers that hold parameters of their own."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if next(m.parameters(recurse=False), None) is not None
    ]


def unreadable(
    model: torch.nn.Module, tp_size: int = 1, described: Collection[str] = ()
) -> list[str]:
    """The layers :func:`check_served` cannot read back (known before any refit).

    Above one rank only the ``described`` layers (whose part this worker declared)."""
    layers = _layers(model)
    if tp_size == 1:
        return [n for n, m in layers if _kind(m) is None]
    known = frozenset(described)
    return [n for n, m in layers if n not in known or _kind(m) is None]


_CHECKS = {"linear": _check_linear, "embedding": _check_embedding, "plain": _check_plain}


@torch.no_grad()
def check_served(
    model: torch.nn.Module,
    weights: Mapping[str, torch.Tensor],
    tp_size: int = 1,
    described: Collection[str] = (),
) -> ServedReport:
    """Read every served layer back against ``weights`` (HF names; above one rank, the
    parts this worker holds)."""
    report = ServedReport()
    skipped = frozenset(unreadable(model, tp_size, described))
    expected = expected_params(model, weights)
    owner = {id(p): n for n, p in model.named_parameters()}
    for name, module in _layers(model):
        kind = _kind(module)
        if kind is None or name in skipped:
            report.unprobed.append(name)
            continue
        report.probed.append(name)
        if kind == "experts":  # named per expert, by the sent tensors
            report.mismatches += _check_experts(module, expected)
            continue
        problem = _CHECKS[kind](module, _own_expected(name, module, expected, owner))
        if problem is not None:
            report.mismatches.append(f"{name}: {problem}")
    return report


def describe(report: ServedReport, limit: int = 3) -> str:
    """A short reason naming the first tensors that differ (for the rank's report)."""
    shown = "; ".join(report.mismatches[:limit])
    more = len(report.mismatches) - limit
    return shown + (f" (and {more} more)" if more > 0 else "")
