#!/usr/bin/env bash
# Install the project's packages (what the README's `pip install -c constraints.txt -e
# ".[test]"` installs) into the active virtual environment from a local wheelhouse, so
# that a CI run on a machine that ran one before downloads nothing.
#
#   bash .ci/wheelhouse.sh            # fill the wheelhouse if needed, then install from it;
#                                     # prints the wheelhouse folder (stdout, alone)
#   bash .ci/wheelhouse.sh --rebuild  # download the wheelhouse anew first
#
# Why: pip keeps no HTTP cache on these machines (the registry's answers are not
# cacheable), so every fresh venv downloaded torch and its nvidia-* wheels again: ~4 GB,
# 4-8 minutes of each CI run, and one of those downloads failed its hash check
# (2026-12-03, nvidia-nvjitlink), which only a second download mended.
#
# The wheels live under ${XDG_CACHE_HOME:-~/.cache}/kube-refit/wheels/<key>, one folder per
# (Python version, ISO week, digest of constraints.txt + pyproject.toml + this script).
# The week is in the key so that unpinned dependencies are fetched anew at least weekly,
# as a fresh install would take them; a change of pins or dependencies refreshes at once.
# A folder is filled in a temporary directory and renamed into place only once `pip wheel`
# succeeded, so an interrupted fill never leaves a half wheelhouse; older folders are
# removed then.  The install itself asks no registry (`--no-index`).  kube-refit's own
# wheel is never kept: the checkout is installed editable.
#
# The install is uv's (its wheel kept in the wheelhouse too, pinned here): it links files
# from its own cache instead of unpacking and byte-compiling torch again, 5-6 minutes of
# pip on 2 busy cores, on the critical path of a warm CI run.  It byte-compiles as pip
# does (in parallel): these machines set PYTHONDONTWRITEBYTECODE, so without the .pyc
# files every worker's `import torch` would compile it again (+1 s each).  Should uv
# fail, pip installs from the same folder.
#
# Exits non-zero with pip's message when the fill or the install fails; the README's own
# pip step then installs from the registry as usual.  .ci/run passes the folder to the
# tests as REFIT_TEST_WHEELHOUSE (tests/e2e/test_image_install.py installs from it too).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
rebuild=0
for arg in "$@"; do
    case "$arg" in
        --rebuild) rebuild=1 ;;
        -h | --help) sed -n '2,33p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "wheelhouse.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
    esac
done

log() { echo "wheelhouse.sh: $*" >&2; }
uv_pin="uv==0.13.9"

if [ -z "${VIRTUAL_ENV:-}" ]; then
    log "no virtual environment is active: activate the one to install into first"
    exit 2
fi
python=python
py_version=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
recipe=$( (grep -v '^[[:space:]]*#' "${BASH_SOURCE[0]}"; cat "$root/constraints.txt" "$root/pyproject.toml") \
         | sha256sum | cut -c1-12)
key="py$py_version-$(date -u +%G-W%V)-$recipe"
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/kube-refit/wheels"
final="$cache_root/$key"
mkdir -p "$cache_root"

# One fill at a time per cache (a second caller waits, then finds it filled).
exec 9>"$cache_root/.lock"
if ! flock -n 9; then
    log "another fill of the wheelhouse is running; waiting for it (up to 30 min)"
    flock -w 1800 9 || { log "gave up waiting for the lock $cache_root/.lock"; exit 1; }
fi
if [ "$rebuild" = 1 ] || [ ! -d "$final" ]; then
    # Holding the lock, any temporary directory left is from a fill that was killed.
    rm -rf "$cache_root"/.fill-*
    tmp=$(mktemp -d "$cache_root/.fill-$key.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    trap 'exit 130' INT TERM HUP
    started=$(date +%s)
    log "filling $final from the registry (~4 GB with torch; once a week, or when the pins change)"
    # The build backend's own requirements too: the editable install builds offline.
    python -m pip wheel --quiet -c "$root/constraints.txt" -w "$tmp" "$root[test]" "setuptools>=68" wheel "$uv_pin" >&2
    rm -f "$tmp"/kube_refit-*.whl
    rm -rf "$final"
    mv "$tmp" "$final"
    trap - EXIT
    find "$cache_root" -mindepth 1 -maxdepth 1 -type d ! -name "$key" ! -name '.fill-*' -exec rm -rf {} +
    log "filled in $(($(date +%s) - started)) s: $(find "$final" -name '*.whl' | wc -l) wheels, $(du -sh "$final" | cut -f1)"
fi
flock -u 9

started=$(date +%s)
offline=(--no-index --find-links "$final" -c "$root/constraints.txt" -e "$root[test]")
if python -m pip install --quiet --no-index --find-links "$final" "$uv_pin" >&2 \
    && python -m uv pip install --quiet --compile-bytecode --python "$(command -v python)" \
        "${offline[@]}" >&2; then
    how=uv
else
    log "uv could not install from $final; pip installs instead"
    python -m pip install --quiet "${offline[@]}" >&2
    how=pip
fi
log "installed kube-refit[test] from $final with $how in $(($(date +%s) - started)) s, no registry asked"
echo "$final"
