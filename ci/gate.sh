#!/usr/bin/env bash
# The parity gate of a CI job: titan-primus doctor, parity, bench and report on this machine, with
# `titan-primus` from PATH. Results go to $ARTIFACTS (default artifacts/NAME): doctor-NAME.txt and
# .json, parity-NAME.json, bench-NAME.json, report-NAME.md (the two side by side) and
# parity-NAME.png (SQNR headroom per case and backend).
#
# It fails when `titan-primus parity` fails: any backend's out, grad_input or grad_weight below the
# SQNR threshold its recipe states (the bars `titan-primus parity` prints: 25 dB vs fp32 for e4m3
# GEMMs, 20 dB with an e5m2 operand, 50 dB in high precision, 40 dB between two runs of one recipe
# definition), a non-finite output, non-zero rows past a grouped GEMM's last group, a backend that
# raised on this machine, or a --require'd backend that ran no case. It also fails when doctor,
# bench (a backend raised) or the report failed. Every step runs, whatever failed before it.
#
# usage: ci/gate.sh NAME [--require BACKEND]... [--compile] [--quick]
#   --require BACKEND  fail unless BACKEND runs here (primus_turbo on MI300X, torchao on CUDA)
#   --compile          bench the ops under torch.compile, as TorchTitan runs them
#   --quick            small case sets (seconds on a CPU)
set -euo pipefail
# shellcheck source=ci/lib.sh
source "$(dirname "$0")/lib.sh"

usage="usage: ci/gate.sh NAME [--require BACKEND]... [--compile] [--quick]"
name=${1:?$usage}
shift
parity=()
bench=()
while (($#)); do
    case $1 in
        --require) parity+=(--require "${2:?--require needs a backend name}"); shift ;;
        --compile) bench+=(--compile) ;;
        --quick) parity+=(--quick); bench+=(--quick) ;;
        *) echo "ci/gate.sh: unknown option '$1'; $usage" >&2; exit 2 ;;
    esac
    shift
done
out=${ARTIFACTS:-artifacts/$name}
mkdir -p "$out"
out=$(cd "$out" && pwd)

doctor() {
    titan-primus doctor | tee "$out/doctor-$name.txt" && titan-primus doctor --json > "$out/doctor-$name.json"
}

# The report of what parity and bench wrote, whatever their exit status.
report() {
    local results=() file
    for file in "$out/parity-$name.json" "$out/bench-$name.json"; do
        if [[ -s $file ]]; then results+=("$file"); fi
    done
    ((${#results[@]})) && titan-primus report "${results[@]}" --png "$out/parity-$name.png" > "$out/report-$name.md"
}

step doctor doctor
step "parity ${parity[*]}" titan-primus parity "${parity[@]}" --json "$out/parity-$name.json"
step "bench ${bench[*]}" titan-primus bench "${bench[@]}" --json "$out/bench-$name.json"
step report report
echo "results of $name: $out"
finish
