#!/usr/bin/env bash
# The newest-stack CI job (the cpu workflow's newest-stack, on GitHub's runners, where pip is not
# capped at torch 2.14.1): make test-newest, the suite and the real-code tier on the newest registry
# torch (2.15.0) with TorchTitan 0.3.0 and TorchAO 0.18.0, in .venv-newest (a CUDA wheel of several
# GB that runs on the CPU). The tier's Primus-Turbo builds come from ci/primus-turbo.sh, and with CI
# set it fails instead of skipping where they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
export CI=${CI:-true}
TITAN_PRIMUS_TURBO_SOURCES=$(ci/primus-turbo.sh)
export TITAN_PRIMUS_TURBO_SOURCES
make test-newest
