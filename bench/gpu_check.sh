#!/usr/bin/env bash
# The CUDA checks, for a machine with a GPU (CI has none): the CUDA test tier and the CUDA
# bench, in under 5 minutes.  Fails loudly without CUDA: nothing here is skipped.
#
#   bash bench/gpu_check.sh            # from the repository root, in the project's venv
#
# 1. tests/gpu/gpu_*.py: the device integrity hash, the engine in VRAM (views, final
#    tensors, tensor-parallel slices copied on the stream before the NIC reads them) and the
#    session's receive modes on CUDA tensors, between real processes;
# 2. bench/refit_throughput.py --device cuda: engine and session path against a raw NIXL
#    VRAM->VRAM WRITE measured in the same run (1x1 and 2x2, 64 MiB buckets).
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: CUDA is not available on this machine; these checks need a GPU")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
PY
start=$SECONDS
timeout 170 python -m pytest -q -p no:cacheprovider --timeout 150 tests/gpu/gpu_*.py
timeout 120 python bench/refit_throughput.py --device cuda --runs 3 --buckets 64 \
    --topologies 1x1,2x2 --json
echo "gpu_check: done in $((SECONDS - start)) s"
