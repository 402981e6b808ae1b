"""The reference side of reading fused MoE experts back: what the served kernel must give.

vLLM serves a mixture-of-experts layer's experts fused (``w13`` ``[E, 2I, H]``: each
expert's gate rows, then its up rows; ``w2`` ``[E, H, I]``) and, on CPU, prepacked into
a layout only its kernel reads.  So the experts are read back by their output, not their
storage: :func:`probe_routing` routes a fixed probe so that each expert gets its own block
of rows (top-1, with fixed weights other than 1, so that the kernel's weighting is
checked too), the served kernel computes it, and :func:`reference_moe` computes the same
from the tensors that were sent, in plain torch (SiLU-and-mul, the router weight applied
to the output, or to the input where the layer says so).  :func:`expert_problems` then
compares block by block, so a difference names the expert's own tensors.

:func:`expert_weights` builds ``w13`` / ``w2`` from the sent tensors by the checkpoint's
per-expert names (``<layer>.<e>.gate_proj.weight`` ...), or from transformers 5's fused
``<layer>.gate_up_proj`` / ``<layer>.down_proj`` where those were sent instead.

Pure: torch only (a contract in pyproject.toml keeps vLLM out).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

#: Why ``live`` is not ``expected`` for ``dtype`` (None: it is): ``vllm_served.differs``.
Differs = Callable[[torch.Tensor, torch.Tensor, torch.dtype], str | None]


@dataclass(frozen=True)
class ExpertNames:
    """How the checkpoint names one MoE layer's experts (vLLM's ``ckpt_*_proj_name``)."""

    layer: str
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def of(self, expert: int) -> tuple[str, str, str]:
        """The gate, up and down tensor names of ``expert``."""
        prefix = f"{self.layer}.{expert}"
        return (
            f"{prefix}.{self.gate}.weight",
            f"{prefix}.{self.up}.weight",
            f"{prefix}.{self.down}.weight",
        )

    def label(self, expert: int) -> str:
        """One name for all three tensors of ``expert`` (a difference in the output cannot
        tell them apart)."""
        return f"{self.layer}.{expert}.{{{self.gate},{self.up},{self.down}}}.weight"


def expert_weights(
    sent: Mapping[str, torch.Tensor], names: ExpertNames, experts: int
) -> tuple[torch.Tensor, torch.Tensor] | str:
    """``(w13, w2)`` as vLLM stacks them, from the sent tensors; or why they cannot be."""
    per_expert = [names.of(e) for e in range(experts)]
    missing = [n for trio in per_expert for n in trio if n not in sent]
    if not missing:
        w13 = torch.stack([torch.cat([sent[g], sent[u]]) for g, u, _ in per_expert])
        return w13, torch.stack([sent[d] for _, _, d in per_expert])
    # transformers 5's fused layout (vLLM's loader takes it too): gate rows, then up rows.
    fused = (f"{names.layer}.gate_up_proj", f"{names.layer}.{names.down}")
    if (names.gate, names.up) == ("gate_proj", "up_proj") and all(n in sent for n in fused):
        w13, w2 = sent[fused[0]], sent[fused[1]]
        if w13.ndim == 3 and w2.ndim == 3 and len(w13) == len(w2) == experts:
            return w13, w2
    shown = ", ".join(missing[:3]) + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
    return f"no tensor was sent for {shown}"


def probe_routing(
    experts: int, rows: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights, topk_ids)`` of ``experts * rows`` probe rows, top-1: rows
    ``[e * rows, (e + 1) * rows)`` go to expert ``e``, with weights from 0.25 to 1
    (float32 and int32, contiguous: what vLLM's CPU router hands its kernel)."""
    ids = torch.arange(experts, dtype=torch.int32).repeat_interleave(rows)
    weights = torch.linspace(0.25, 1.0, rows, dtype=torch.float32).repeat(experts)
    return (
        weights.unsqueeze(1).contiguous().to(device),
        ids.unsqueeze(1).contiguous().to(device),
    )


def reference_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor],
    weight_on_input: bool = False,
) -> torch.Tensor:
    """What a gated SiLU MoE computes for ``x`` ``[T, H]`` routed by ``routing``
    (``topk_weights``, ``topk_ids``, each ``[T, k]``), in float32."""
    topk_weights, topk_ids = routing
    x, w13, w2 = x.float(), w13.float(), w2.float()
    out = torch.zeros(x.shape[0], w2.shape[1], device=x.device)
    for slot in range(topk_ids.shape[1]):
        for expert in sorted(set(topk_ids[:, slot].tolist())):
            rows = topk_ids[:, slot] == expert
            weight = topk_weights[rows, slot].float().unsqueeze(1)
            h = x[rows] * weight if weight_on_input else x[rows]
            gate, up = torch.nn.functional.linear(h, w13[expert]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[expert])
            out[rows] += y if weight_on_input else y * weight
    return out


def expert_problems(
    live: torch.Tensor,
    reference: torch.Tensor,
    topk_ids: torch.Tensor,
    names: ExpertNames,
    *,
    differs: Differs,
    dtype: torch.dtype,
) -> list[str]:
    """``"<expert's tensors>: <why>"`` for each expert whose rows (top-1 ``topk_ids``)
    differ from the reference; empty: every expert serves what was sent."""
    problems = []
    for expert in sorted(set(topk_ids[:, 0].tolist())):
        rows = topk_ids[:, 0] == expert
        problem = differs(live[rows], reference[rows], dtype)
        if problem is not None:
            problems.append(f"{names.label(int(expert))}: {problem}")
    return problems
