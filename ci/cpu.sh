#!/usr/bin/env bash
# CPU CI, what .ci/run and the cpu workflow run, on a fresh clone on any Linux x86-64 machine with
# Python 3.11 and a package registry: the lint gate, the README's test command, the CPU parity gate
# (results in artifacts/cpu), then the TorchTitan 0.2.x suite on the current stack and on the oldest
# one the project supports (torch 2.12, torchao 0.15: AMD's images). Stops at the first failure.
#
# Each suite has its own venv of 5-6 GB (torch's registry wheels are CUDA builds). A venv this
# script created is removed once its suite has passed, so the run peaks at one venv's worth of
# disk instead of three; venvs that were there before are left alone.
set -euo pipefail
cd "$(dirname "$0")/.."

need_gb=8
free_gb=$(df -Pk . | awk 'NR == 2 { print int($4 / 1048576) }')
if ((free_gb < need_gb)); then
    echo "ci/cpu.sh: ${free_gb} GB free here; a suite's venv and pip's downloads need about" \
         "${need_gb} GB. Free some disk and rerun." >&2
    exit 1
fi

created=()
for venv in .venv .venv-tt02 .venv-oldest; do
    [[ -e $venv ]] || created+=("$venv")
done
drop_if_created() {
    local venv
    for venv in "${created[@]}"; do
        if [[ $venv == "$1" ]]; then rm -rf "$venv"; fi
    done
}

make lint
make test
OMP_NUM_THREADS=1 PATH="$PWD/.venv/bin:$PATH" ci/gate.sh cpu
drop_if_created .venv
make test-tt02
drop_if_created .venv-tt02
make test-oldest
drop_if_created .venv-oldest
