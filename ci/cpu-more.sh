#!/usr/bin/env bash
# The cpu workflow's cpu-more job, beside ci/cpu.sh (which .ci/run runs): what that script leaves out
# to stay well under CI's time limit on one 2-core machine (docs/ci.md). The real-code tier's other
# runs (make test-turbo-more: the Makefile's TURBO_MORE_RUNS, its Primus-Turbo builds from
# ci/primus-turbo.sh, failing instead of skipping where they are missing), then the canary on
# TorchTitan's next line, TorchTitan main (2026-08-21): the 0.3 adapter's converter, shapes,
# activation-checkpointing and trainer tests (make test-tt-next). Stops at the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export CI=${CI:-true}
TITAN_PRIMUS_TURBO_SOURCES=$(ci/primus-turbo.sh)
export TITAN_PRIMUS_TURBO_SOURCES
make test-turbo-more
make test-tt-next
