#!/usr/bin/env bash
# CUDA CI: the real TorchAO FP8 kernels, on any Linux machine with an NVIDIA SM89+ GPU (L40S, H100,
# H200, B200), its driver and Python 3.11 (`python3`, or PYTHON=...). `make setup` builds .venv with
# torch 2.14.1 from PyPI, a CUDA build; then the cuda-marked tests and the parity gate with TorchAO
# required (ci/gate.sh). Results go to $ARTIFACTS (default artifacts/cuda). Every step after the
# setup runs; the script fails at the end if any did.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/lib.sh
export ARTIFACTS=${ARTIFACTS:-$PWD/artifacts/cuda}

make setup
export PATH="$PWD/.venv/bin:$PATH"
# Elsewhere the cuda tests would only skip, and TorchAO runs on a CPU too: refused here instead.
python -c 'import sys, titan_primus as tp; d = tp.detect_device()
sys.exit(0 if d.kind == "cuda" and d.fp8_hardware else f"ci/cuda.sh: needs an NVIDIA SM89+ GPU; this is {d.arch}")'
step "cuda-marked tests (real TorchAO kernels)" python -m pytest -q -m cuda tests
step "parity gate, TorchAO required" ci/gate.sh cuda --require torchao --compile
step "validate (FP8 vs bf16 on TorchTitan's trainer)" ci/validate.sh cuda --module llama3 --config llama3_debugmodel --steps 300
echo "CUDA results: $ARTIFACTS"
finish
