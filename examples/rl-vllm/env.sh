# Source me from the repository root: `. examples/rl-vllm/env.sh`
#
# Makes (or finds cached) the vLLM environment (tests/engines/install.sh: vLLM's CPU
# build, the pinned torch, transformers, kube-refit's dependencies) and exports what the
# RL example's pods run with:
#   RL_VLLM_PYTHON  that environment's Python (trainer and rollout alike)
#   RL_VLLM_DIR     this directory (policy.py, rollout.py, tiny_llama.py)
#   PYTHONPATH            this checkout's worker/ first (kube-refit is not installed
#                         into the cached environment, so it never runs a stale copy)
# Then: refit run examples/rl-vllm/job.yaml
_rl_vllm_dir=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)
_rl_vllm_root=$(cd "$_rl_vllm_dir/../.." && pwd)
if _rl_vllm_venv=$(bash "$_rl_vllm_root/tests/engines/install.sh"); then
    export RL_VLLM_PYTHON="$_rl_vllm_venv/bin/python"
    export RL_VLLM_DIR="$_rl_vllm_dir"
    export PYTHONPATH="$_rl_vllm_root/worker${PYTHONPATH:+:$PYTHONPATH}"
    echo "rl-vllm: ready; now run: refit run examples/rl-vllm/job.yaml" >&2
else
    echo "rl-vllm: the vLLM environment could not be installed (see above)" >&2
    false
fi
unset _rl_vllm_dir _rl_vllm_root _rl_vllm_venv
