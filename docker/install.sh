#!/bin/sh
# Installs kube-refit into a virtual environment.  The Dockerfile runs this script, and
# tests/e2e/test_image_install.py replays it in a fresh venv, so the image's install steps
# are tested without a Docker engine.
#
# usage: install.sh torch   VENV SRC   create VENV and install the torch pinned in SRC/constraints.txt
#        install.sh project VENV SRC   install kube-refit from SRC into VENV, then run each entrypoint
#
# env:   TORCH_VARIANT    cpu (default) or a CUDA wheel tag such as cu128: picks the PyTorch index
#        TORCH_INDEX_URL  overrides that index; set but empty: use pip's own configuration
#        PYTHON           the interpreter that creates the venv (default python3)
set -eu

usage() {
    echo "usage: $0 torch|project VENV SRC" >&2
    exit 2
}

[ $# -eq 3 ] || usage
step=$1
venv=$2
src=$3
constraints="$src/constraints.txt"
if [ ! -f "$constraints" ]; then
    echo "install.sh: no constraints file at $constraints" >&2
    exit 2
fi

case "$step" in
torch)
    variant=${TORCH_VARIANT:-cpu}
    case "$variant" in
    cpu | cu[0-9][0-9] | cu[0-9][0-9][0-9]) ;;
    *)
        echo "install.sh: TORCH_VARIANT '$variant' is neither cpu nor a CUDA tag like cu128" >&2
        exit 2
        ;;
    esac
    if ! pin=$(grep -E '^torch==' "$constraints"); then
        echo "install.sh: $constraints pins no torch==VERSION" >&2
        exit 2
    fi
    index=${TORCH_INDEX_URL-https://download.pytorch.org/whl/$variant}
    "${PYTHON:-python3}" -m venv "$venv"
    # torch first and alone: a later unpinned torch requirement (nixl's) then finds it
    # satisfied instead of pulling a multi-GB build from the default index.
    if [ -n "$index" ]; then
        "$venv/bin/python" -m pip install --no-cache-dir --index-url "$index" "$pin"
    else
        "$venv/bin/python" -m pip install --no-cache-dir "$pin"
    fi
    ;;
project)
    if [ ! -x "$venv/bin/python" ]; then
        echo "install.sh: $venv has no python; run the torch step first" >&2
        exit 2
    fi
    "$venv/bin/python" -m pip install --no-cache-dir -c "$constraints" "$src"
    # Fail the build, not the pod, when an entrypoint cannot start.
    for entry in refit refit-worker refit-signal; do
        if ! "$venv/bin/$entry" --help >/dev/null; then
            echo "install.sh: '$entry --help' failed in $venv" >&2
            exit 1
        fi
    done
    ;;
*) usage ;;
esac
