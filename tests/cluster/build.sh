#!/usr/bin/env bash
# Build the real control plane of the cluster test tier -- etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler -- from the Go modules pinned in go/go.mod, or
# reuse the binaries cached for exactly that pin.
#
#   bash tests/cluster/build.sh           # prints the directory holding the four binaries
#   bash tests/cluster/build.sh --rebuild # ignore (and replace) the cached binaries
#
# Progress and timings go to stderr; stdout is only the binary directory, so callers can
# read it.  The cache lives under ${XDG_CACHE_HOME:-~/.cache}/kube-refit/control-plane/,
# one directory per (kubernetes, etcd, Go, recipe) key.  A build goes to a temporary
# directory that is renamed into place only once every binary built and answered
# --version, so an interrupted build never leaves a half cache.  No Go toolchain, or a
# failed build, is an error (exit 2 / 1), never a silent fallback.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mod_dir="$here/go"
rebuild=0
for arg in "$@"; do
    case "$arg" in
        --rebuild) rebuild=1 ;;
        -h | --help) sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
    esac
done

log() { echo "build.sh: $*" >&2; }

if ! command -v go >/dev/null 2>&1; then
    log "no Go toolchain on PATH. The cluster test tier builds kube-apiserver, etcd and the"
    log "other control-plane components from Go modules; install Go $(awk '$1 == "go" {print $2}' "$mod_dir/go.mod") or newer"
    log "(https://go.dev/dl/) and put its bin/ on PATH."
    exit 2
fi

# The pins, read from go.mod so this script cannot drift from it.
pin() {
    awk -v m="$1" '$1 == "require" { $1 = ""; $0 = $0 } $1 == m && $2 ~ /^v/ { print $2; exit }' \
        "$mod_dir/go.mod"
}
kube_version=$(pin k8s.io/kubernetes)
etcd_version=$(pin go.etcd.io/etcd/server/v3)
if [ -z "$kube_version" ] || [ -z "$etcd_version" ]; then
    log "cannot read the k8s.io/kubernetes or etcd pin from $mod_dir/go.mod"
    exit 2
fi
go_version=$(go env GOVERSION)

# Build settings.  GOTOOLCHAIN=local: use the Go on PATH, never download another one.
# nojsonv2: Go 1.27's encoding/json v2 breaks the apiserver's OpenAPI endpoint (kubectl
# apply then cannot download openapi); on Go 1.26 it is already the default.
export GOTOOLCHAIN=local
export GOEXPERIMENT="${GOEXPERIMENT:+$GOEXPERIMENT,}nojsonv2"
export CGO_ENABLED=0
jobs="${KUBE_REFIT_BUILD_JOBS:-$(nproc)}"

major=${kube_version#v}; major=${major%%.*}
minor=${kube_version#v*.}; minor=${minor%%.*}
build_date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
stamp=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    stamp+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    stamp+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done
ldflags="-s -w$stamp"

# The cache key: the pins, the Go release, and a digest of the recipe (go.mod, go.sum, the
# flags), so a changed recipe never reuses binaries built by an older one.
build_flags="-mod=readonly -buildvcs=false -trimpath"
recipe=$( (cat "$mod_dir/go.mod" "$mod_dir/go.sum"; echo "$build_flags ${ldflags//$build_date/} $GOEXPERIMENT $CGO_ENABLED") | sha256sum | cut -c1-12)
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/kube-refit/control-plane"
key="kubernetes-$kube_version-etcd-$etcd_version-$go_version-$recipe"
final="$cache_root/$key"
mkdir -p "$cache_root"

# One build at a time per cache (a second caller waits, then finds the cache warm).
exec 9>"$cache_root/.lock"
if ! flock -n 9; then
    log "another build of the control plane is running; waiting for it (up to 30 min)"
    flock -w 1800 9 || { log "gave up waiting for the lock $cache_root/.lock"; exit 1; }
fi

binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler)
if [ "$rebuild" = 0 ] && [ -d "$final" ]; then
    log "cached: kubernetes $kube_version, etcd $etcd_version in $final"
    echo "$final"
    exit 0
fi

# Holding the lock, any temporary directory left is from a build that was killed.
rm -rf "$cache_root"/.build-*
tmp=$(mktemp -d "$cache_root/.build-$key.XXXXXX")
chmod 755 "$tmp"
trap 'rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM HUP
log "building kubernetes $kube_version and etcd $etcd_version with $go_version ($jobs jobs) into $final"
start_all=$(date +%s)
cd "$mod_dir"
for name in "${binaries[@]}"; do
    case "$name" in
        etcd) pkg=go.etcd.io/etcd/server/v3 ;;
        *) pkg=k8s.io/kubernetes/cmd/$name ;;
    esac
    start=$(date +%s)
    # shellcheck disable=SC2086  # build_flags is a list of flags
    if ! go build $build_flags -p "$jobs" -ldflags "$ldflags" -o "$tmp/$name" "$pkg"; then
        log "FAILED to build $name ($pkg); nothing was cached"
        exit 1
    fi
    # A binary that cannot even print its version is not worth caching.
    if ! version=$("$tmp/$name" --version 2>&1); then
        log "FAILED: the freshly built $name does not run: $version"
        exit 1
    fi
    log "built $name in $(($(date +%s) - start)) s: $(echo "$version" | head -1)"
done
if [ -d "$final" ]; then rm -rf "$final"; fi
mv "$tmp" "$final"
trap - EXIT
log "control plane built in $(($(date +%s) - start_all)) s"
echo "$final"
