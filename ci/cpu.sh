#!/usr/bin/env bash
# CPU CI, what .ci/run and the cpu workflow run, on a fresh clone on any Linux x86-64 machine with
# Python 3.11, git and a package registry: the lint gate, the README's test command (the suite and
# the tier on Primus-Turbo's own code at the Makefile's TURBO_RUNS: ci/primus-turbo.sh fetches its
# builds from GitHub where they are not beside the checkout), the CPU parity gate (results in
# artifacts/cpu), then the TorchTitan 0.2.x suite on the oldest stack the project supports (torch
# 2.12, torchao 0.15: AMD's images) and, at the same time, on the current one. Stops at the first
# failure (the two 0.2.x suites both finish). The tier's
# other runs and the canary on TorchTitan main are ci/cpu-more.sh's, the MoE validate
# ci/cpu-moe.sh's: jobs of the cpu workflow beside this one, so that this script, which .ci/run
# runs on one 2-core machine, stays well under CI's time limit (docs/ci.md).
#
# Each suite has its own venv of 5-6 GB (torch's registry wheels are CUDA builds), in one folder
# outside the clone, the same for every clone on this machine (TITAN_PRIMUS_CI_VENVS, default
# ~/.cache/titan-primus/ci-venvs; the Makefile's VENVS): a venv's path is part of the key inductor
# gives each C++ kernel it compiles, so venvs in a fresh clone compiled every kernel again (a
# compile-heavy part of the suite took 100 s there against 37 s at a path seen before,
# 2026-12-05). One run at a time uses the folder (a lock). A venv is kept for the next run while
# what installs it is unchanged (ci/venv_key.py: venvs.mk, which holds every pin and pip step, and
# pyproject.toml's dependency tables), and made again from nothing when it changed; make installs
# this clone into it either way (its stamp is older than a fresh clone's pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."

export VENVS=${TITAN_PRIMUS_CI_VENVS:-$HOME/.cache/titan-primus/ci-venvs}
mkdir -p "$VENVS"
exec 9> "$VENVS/.lock"
if ! flock -n 9; then
    echo "ci/cpu.sh: another CI run holds $VENVS; waiting for it" >&2
    flock 9
fi

key=$(python3 ci/venv_key.py)
for venv in .venv .venv-tt02 .venv-oldest; do
    if [[ $(cat "$VENVS/$venv/.ci-key" 2> /dev/null) != "$key" ]]; then
        rm -rf "${VENVS:?}/$venv"
        mkdir -p "$VENVS/$venv"
        echo "$key" > "$VENVS/$venv/.ci-key"
    fi
done

need_gb=8
free_gb=$(df -Pk "$VENVS" | awk 'NR == 2 { print int($4 / 1048576) }')
if ((free_gb < need_gb)); then
    echo "ci/cpu.sh: ${free_gb} GB free here; a suite's venv and pip's downloads need about" \
         "${need_gb} GB. Free some disk and rerun." >&2
    exit 1
fi

# Each step's wall time on stderr, for the table in docs/ci.md.
timed() {
    local start=$SECONDS
    "$@"
    echo "== ci/cpu.sh: $* took $((SECONDS - start)) s" >&2
}

timed make lint

# The real-code tier (make test runs it) fails here instead of skipping where its Primus-Turbo
# sources are missing (CI set), and ci/primus-turbo.sh brings them where they are not beside the
# checkout: the four builds, pinned by commit.
export CI=${CI:-true}
TITAN_PRIMUS_TURBO_SOURCES=$(ci/primus-turbo.sh)
export TITAN_PRIMUS_TURBO_SOURCES

# Building .venv-oldest downloads torch 2.12 and its CUDA libraries from PyPI: about 8 minutes
# when pip's cache is cold, nearly all of it waiting on the network. Where the disk holds two
# venvs, it is built in the background while make test keeps the CPUs busy, and where it holds
# three, .venv-tt02 after it (about 90 s of pip, off the critical path).
builder=
if ((free_gb >= 2 * need_gb)); then
    builder_log=$(mktemp)
    # A process group of its own, so that a failure here stops the whole build.
    if ((free_gb >= 3 * need_gb)); then
        setsid make setup-oldest setup-tt02 > "$builder_log" 2>&1 &
    else
        setsid make setup-oldest > "$builder_log" 2>&1 &
    fi
    builder=$!
    trap 'kill -- -"$builder" 2>/dev/null || true' EXIT
fi

timed make test
timed env OMP_NUM_THREADS=1 PATH="$VENVS/.venv/bin:$PATH" ci/gate.sh cpu
# validate: --quick (llama3) runs in make test's suite, from a wheel of this checkout
# (tests/integrations/torchtitan/v0_3/test_validate.py), which fails on its verdicts; the MoE validate is the cpu workflow's
# cpu-moe job (ci/cpu-moe.sh), beside this one.
if [[ -n $builder ]]; then
    echo "== the venvs built in the background"
    status=0
    wait "$builder" || status=$?
    trap - EXIT
    cat "$builder_log"
    rm -f "$builder_log"
    if ((status)); then exit "$status"; fi
fi
# The two TorchTitan 0.2.x suites at once, each in its own venv: one after the other, each left a
# core idle for a seventh of its time (its trainer runs' start-ups and ends, its last tests), which
# the other now fills (docs/ci.md). test-oldest's output follows test-tt02's; both run to the end,
# and either failing fails the run.
oldest_log=$(mktemp)
timed make test-oldest > "$oldest_log" 2>&1 &
oldest=$!
tt02_status=0
timed make test-tt02 || tt02_status=$?
oldest_status=0
wait "$oldest" || oldest_status=$?
echo "== make test-oldest (beside make test-tt02)"
cat "$oldest_log"
rm -f "$oldest_log"
if ((tt02_status || oldest_status)); then exit 1; fi
