#!/usr/bin/env bash
# The MoE validate of the cpu workflow (its cpu-moe job, beside ci/cpu.sh's): deepseek_v3 debug on 2
# gloo ranks, expert parallel degree 2, FP8 token dispatch, 10 steps of 64 tokens (docs/validate.md),
# results in artifacts/cpu (or $ARTIFACTS). A job of its own so that ci/cpu.sh, which .ci/run runs
# on one 2-core machine, stays under CI's time limit: the four trainer runs take about 6 minutes
# there.
set -euo pipefail
cd "$(dirname "$0")/.."
make setup
export ARTIFACTS=${ARTIFACTS:-artifacts/cpu}
OMP_NUM_THREADS=1 PATH="$PWD/.venv/bin:$PATH" ci/validate.sh cpu-moe --module deepseek_v3 \
    --config deepseek_v3_debugmodel --steps 10 --seq-len 64 --nproc 2 --fp8-dispatch \
    -- --parallelism.expert_parallel_degree 2 --training.disable_cuda_graphs
