"""The engines tier's architecture matrix: tiny models built here, never downloaded.

Each :data:`ARCHS` entry names a transformers model class and a config small enough for
a 2-core machine, chosen for what it exercises in vLLM's loader:

- ``llama``: untied embeddings, fused qkv and gate/up (the tier's original model);
- ``qwen2-tied``: Qwen2 with tied word embeddings, q/k/v biases, GQA (8 query heads over
  2 KV heads, head_dim 32) and a vocabulary that is no multiple of vLLM's padding (64);
- ``qwen2-moe``: Qwen2-MoE, 4 experts, top-2, a shared expert with its gate.  transformers
  5 holds the experts fused (``experts.gate_up_proj`` ``[E, 2I, H]``); its checkpoint
  stores them per expert.
- ``qwen2-moe-tied``: the same with tied word embeddings (the tensor-parallel case);
- ``mixtral``: Mixtral, 4 experts, top-2, no shared expert.  Besides fusing the experts,
  transformers 5 renames its MoE block: ``mlp.experts.gate_up_proj`` and ``mlp.gate`` in
  memory are ``block_sparse_moe.experts.<e>.w1/w3.weight`` and ``block_sparse_moe.gate``
  in its checkpoint.

All share ``tiny_llama``'s tokenizer, prompts and corpus, so greedy tokens mean the same
everywhere.  :func:`hf_reference` is the ground truth the trainer sends along with each
refit: HF ``generate``'s greedy tokens and the log-probability of each of them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "rl-vllm"))

import tiny_llama

ATTN = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
COMMON = {
    "vocab_size": len(tiny_llama.vocabulary()),
    "num_hidden_layers": 2,
    "max_position_embeddings": 128,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": 0,
}
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {**ATTN, "intermediate_size": 256, "tie_word_embeddings": False},
    ),
    "qwen2-tied": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {
            "hidden_size": 256,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 256,
            "tie_word_embeddings": True,
        },
    ),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            **ATTN,
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "tie_word_embeddings": False,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {
            **ATTN,
            "intermediate_size": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": False,
        },
    ),
}
# The tensor-parallel case's model: the MoE with its embeddings tied, so that one engine
# start covers q/k/v (GQA, biases), gate/up, the experts, a router, and the tied,
# padded vocabulary split unevenly over the ranks.
ARCHS["qwen2-moe-tied"] = (
    ARCHS["qwen2-moe"][0],
    ARCHS["qwen2-moe"][1],
    {**ARCHS["qwen2-moe"][2], "tie_word_embeddings": True},
)


def build_model(arch: str, seed: int, dtype: str = "float32") -> Any:
    """A freshly initialised tiny model of ``arch`` (deterministic for ``seed``)."""
    import transformers

    config_cls, model_cls, size = ARCHS[arch]
    config = getattr(transformers, config_cls)(**COMMON, **size, torch_dtype=dtype)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    return model.to(getattr(torch, dtype)).eval()


@torch.no_grad()
def hf_reference(model: Any) -> tuple[list[list[int]], list[list[float]]]:
    """HF ``generate``'s greedy tokens for the fixed prompts and each token's logprob."""
    tokens = tiny_llama.hf_greedy(model)
    return tokens, tiny_llama.hf_logprobs(model, tokens)


def vllm_reference(llm: Any) -> tuple[list[list[int]], list[list[float]], list[Any]]:
    """vLLM's greedy tokens for the same prompts, the logprob of each one, and the
    ``RequestOutput`` objects (their weight versions).

    ``ignore_eos`` without ``min_tokens``: the checkpoints have no EOS, and vLLM's
    min-tokens processor indexes one past the vocabulary of Qwen2 configs without one."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=tiny_llama.NEW_TOKENS, ignore_eos=True, logprobs=0
    )
    prompts = [{"prompt_token_ids": list(p)} for p in tiny_llama.PROMPTS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [
        [float(step[t].logprob) for step, t in zip(o.outputs[0].logprobs, toks, strict=True)]
        for o, toks in zip(outputs, tokens, strict=True)
    ]
    return tokens, logprobs, list(outputs)


def logprob_gap(got: list[list[float]], want: list[list[float]]) -> float:
    """The largest difference between two prompts x tokens tables of logprobs."""
    return max(
        abs(a - b) for x, y in zip(got, want, strict=True) for a, b in zip(x, y, strict=True)
    )
