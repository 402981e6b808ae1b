"""A tiny Llama, its tokenizer and its data, built here: nothing is downloaded from a hub.

Shared by the RL example's trainer and rollout (``examples/rl-vllm``), the engines test
tier (``tests/engines``) and the landing bench (``bench/vllm_landing.py``), so all of them
agree on the model, the fixed prompts and what "greedy tokens" means:

- :func:`build_tokenizer`: a ``tokenizers`` WordLevel tokenizer over the words of
  :data:`TEXT` (a small built-in text), saved as ``tokenizer.json``;
- :func:`llama_config`: hidden 128, 4 attention heads over 2 KV heads, head_dim 32 (vLLM's
  CPU attention refuses 16), untied embeddings, no EOS (generation runs its full length);
- :func:`save_checkpoint`: a directory vLLM and transformers both load (config, safetensors,
  tokenizer);
- :func:`hf_greedy` / :func:`vllm_greedy`: greedy tokens for :data:`PROMPTS`, by
  ``transformers`` ``generate`` and by a vLLM ``LLM``; :func:`hf_logprobs`: HF's logprob
  of each of them;
- :func:`start_llm`: vLLM in-process on CPU, small KV cache (the settings in docs/engines.md),
  prefix caching on with 32-token blocks: the prompts share a 72-token prefix.

Must not import: vLLM at module import time (the trainer never loads it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

#: The built-in corpus the example trains on (and the tokenizer's vocabulary).
CORPUS = """
the policy learns from the rollout and the rollout serves the policy . every step the
trainer moves its weights to the engine and the engine answers with new tokens . a node
may drain at any time so the job stops at a safe point and starts again from the last
refit . the weights travel over the network once and land whole or not at all . small
models learn small things but the path they take is the same as the path of large ones .
"""
#: The corpus as words.
TEXT: list[str] = CORPUS.split()

#: Fixed prompts (as words) whose greedy continuation both sides compare after a refit.
PROMPT_WORDS = (
    "the policy learns",
    "every step the trainer",
    "a node may drain",
    "the weights travel over",
)
#: Tokens generated per prompt for the check.
NEW_TOKENS = 8
UNKNOWN = "[unk]"


def vocabulary() -> list[str]:
    """Sorted, de-duplicated words of :data:`TEXT`, after the unknown token."""
    return [UNKNOWN, *sorted(set(TEXT))]


def build_tokenizer() -> Any:
    """The WordLevel tokenizer (a ``tokenizers.Tokenizer``) over :func:`vocabulary`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {word: i for i, word in enumerate(vocabulary())}
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token=UNKNOWN))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return tokenizer


def encode(words: str) -> list[int]:
    vocab = {word: i for i, word in enumerate(vocabulary())}
    return [vocab.get(w, 0) for w in words.split()]


#: What every prompt starts with, as RL prompts share a system prompt (and GRPO samples
#: each prompt several times): 72 tokens fill two of :func:`start_llm`'s 32-token KV
#: blocks, which vLLM's prefix cache keeps and serves to every later prompt sharing them.
SHARED_PREFIX_TOKENS = 72
PROMPTS: tuple[tuple[int, ...], ...] = tuple(
    tuple(encode(" ".join((TEXT * 2)[:SHARED_PREFIX_TOKENS]) + " " + p)) for p in PROMPT_WORDS
)


def corpus_ids() -> torch.Tensor:
    """The whole text as token ids (int64)."""
    return torch.tensor(encode(" ".join(TEXT)), dtype=torch.int64)


#: The tiny model's size; the landing bench overrides these to measure a larger one.
SIZE: dict[str, int] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def llama_config(dtype: str = "float32", **size: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=size.pop("vocab_size", len(vocabulary())),
        **{**SIZE, **size},
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        torch_dtype=dtype,
    )


def build_model(seed: int, dtype: str = "float32", **size: int) -> Any:
    """A freshly initialised ``LlamaForCausalLM`` (deterministic for ``seed``; ``size``
    overrides :data:`SIZE` and the vocabulary size)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(dtype, **size))
    return model.to(getattr(torch, dtype)).eval()


def save_checkpoint(model: Any, directory: Path) -> Path:
    """Save ``model`` (safetensors), its config and the tokenizer under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": UNKNOWN,
                "pad_token": UNKNOWN,
                "model_max_length": 128,
            }
        )
    )
    return directory


@torch.no_grad()
def hf_greedy(model: Any, prompts: Sequence[Sequence[int]] = PROMPTS) -> list[list[int]]:
    """Greedy continuations by transformers ``generate``, prompt by prompt (no padding)."""
    out: list[list[int]] = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.int64)
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append([int(t) for t in gen[0, ids.shape[1] :]])
    return out


@torch.no_grad()
def hf_logprobs(
    model: Any, tokens: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]] = PROMPTS
) -> list[list[float]]:
    """The logprob ``model`` gives each of ``tokens`` after its prompt (log-softmax of the
    logits at that position, teacher-forced): what an engine serving the same weights
    reports for the same tokens, up to its kernels' rounding."""
    out = []
    for prompt, new in zip(prompts, tokens, strict=True):
        ids = torch.tensor([[*prompt, *new]], dtype=torch.int64)
        scores = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        first = len(prompt) - 1
        out.append([float(scores[first + i, t]) for i, t in enumerate(new)])
    return out


def vllm_env() -> None:
    """The environment vLLM needs here: CPU, in-process, no thread pinning."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def start_llm(model_dir: Path, dtype: str = "float32", **kwargs: Any) -> Any:
    """vLLM's ``LLM`` for ``model_dir`` in-process on CPU (call :func:`shutdown_llm`)."""
    vllm_env()
    from vllm import LLM

    # In-process worker unless the caller asks otherwise (tensor parallelism: "mp").
    kwargs.setdefault("distributed_executor_backend", "uni")
    return LLM(
        model=str(model_dir),
        dtype=dtype,
        kv_cache_memory_bytes=8 << 20,
        max_model_len=128,
        max_num_seqs=len(PROMPTS),
        enforce_eager=True,
        seed=0,
        # vLLM's default for generative models, made explicit: the shared prefix of
        # PROMPTS is then served from KV blocks cached by an earlier request.
        enable_prefix_caching=True,
        block_size=32,
        **kwargs,
    )


def vllm_greedy(llm: Any, prompts: Sequence[Sequence[int]] = PROMPTS) -> list[list[int]]:
    """Greedy continuations by vLLM for the same prompts (token ids in, token ids out)."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, ignore_eos=True
    )
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def vllm_answers(
    llm: Any, lora_request: Any = None
) -> tuple[list[list[int]], list[list[float]], str | None]:
    """vLLM's greedy tokens for :data:`PROMPTS`, each token's logprob, and the name of
    the LoRA adapter that answered (None: the base), served with ``lora_request``."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": list(p)} for p in PROMPTS]
    outputs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [
        [float(step[t].logprob) for step, t in zip(o.outputs[0].logprobs, toks, strict=True)]
        for o, toks in zip(outputs, tokens, strict=True)
    ]
    served = outputs[0].lora_request.lora_name if outputs[0].lora_request else None
    return tokens, logprobs, served


def shutdown_llm(llm: Any) -> None:
    """Shut the engine down explicitly (a spawned engine process can hang at exit else)."""
    llm.llm_engine.engine_core.shutdown()
