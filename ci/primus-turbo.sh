#!/usr/bin/env bash
# The four Primus-Turbo builds the real-code tier runs (tests/real_turbo), for ci/cpu.sh: prints the
# folder that holds them, for TITAN_PRIMUS_TURBO_SOURCES. That is, in this order:
#   - TITAN_PRIMUS_TURBO_SOURCES, where set;
#   - shared/primus-turbo beside the checkout or beside the nearest folder above it that has one
#     (tests/real_turbo/loader.py's default), where it holds every build; for a clone of a local
#     checkout, then the same beside that checkout;
#   - .primus-turbo/ in the checkout (ignored by git).
# A build missing there is fetched from AMD-AGI/Primus-Turbo (TITAN_PRIMUS_TURBO_REPO overrides the
# URL, e.g. for a mirror) at the commit pinned below, by full SHA, its primus_turbo/ folder only
# (what Python and Triton run), and checked to be that commit. The pins are the commits
# shared/primus-turbo/*/SOURCE name (tests/unit/test_cli_ci.py checks they agree).
set -euo pipefail
cd "$(dirname "$0")/.."

# BUILD=COMMIT: the folder name the tier is told (TITAN_PRIMUS_TURBO_BUILD), the commit it holds.
pins=(
    v0.3.1=69965a9dea7521ef9fbba63cbd2969ef5bc7532d
    v0.3.2.dev48=edc8d2ccb0be4888e80ee7c6e765fd3956026a32
    v0.4.0=b7d7086f6c3779b9fbd0ea9ed6997f98565e7311
    v0.4.1.dev26=a6a16cdce46bd2235a248b41f501fb363c215b9b
)
repo=${TITAN_PRIMUS_TURBO_REPO:-https://github.com/AMD-AGI/Primus-Turbo}

holds_every_build() {
    local pin
    for pin in "${pins[@]}"; do
        [[ -d $1/${pin%%=*}/primus_turbo ]] || return 1
    done
}

# shared/primus-turbo beside $1 or beside the nearest folder above it that has one, if it holds
# every build.
shared_beside() {
    local dir=$1
    while [[ $dir != / ]]; do
        dir=$(dirname "$dir")
        if [[ -d $dir/shared/primus-turbo ]]; then
            if holds_every_build "$dir/shared/primus-turbo"; then echo "$dir/shared/primus-turbo"; fi
            return
        fi
    done
}

sources=${TITAN_PRIMUS_TURBO_SOURCES:-}
if [[ -z $sources ]]; then
    sources=$(shared_beside "$PWD")
fi
# A clone of a local checkout (a fresh clone in a temporary folder): beside the checkout it came from.
origin=$(git config --get remote.origin.url 2>/dev/null || true)
if [[ -z $sources && -d $origin ]]; then
    sources=$(shared_beside "$(cd "$origin" && pwd)")
fi
sources=${sources:-$PWD/.primus-turbo}

for pin in "${pins[@]}"; do
    build=${pin%%=*} commit=${pin#*=}
    [[ -d $sources/$build/primus_turbo ]] && continue
    echo "== Primus-Turbo $build: fetching $repo at $commit (primus_turbo/ only) into $sources/$build" >&2
    partial=$sources/$build.partial
    rm -rf "$partial"
    mkdir -p "$partial"
    git -C "$partial" init -q
    git -C "$partial" remote add origin "$repo"
    git -C "$partial" sparse-checkout set --no-cone /primus_turbo/
    git -C "$partial" fetch -q --depth 1 --filter=blob:none origin "$commit"
    git -C "$partial" -c advice.detachedHead=false checkout -q FETCH_HEAD
    got=$(git -C "$partial" rev-parse HEAD)
    if [[ $got != "$commit" ]]; then
        echo "ci/primus-turbo.sh: $repo gave $got for Primus-Turbo $build, pinned at $commit" >&2
        exit 1
    fi
    rm -rf "${partial:?}/.git"
    mv "$partial" "$sources/$build"
done
echo "$sources"
