#!/usr/bin/env bash
# CUDA CI: the real TorchAO FP8 kernels, on any Linux machine with an NVIDIA SM89+ GPU (L40S, H100,
# H200, B200) and its driver. Results go to $ARTIFACTS (default artifacts/cuda). Every step after
# the setup runs; the script fails at the end if any did.
#
# usage: ci/cuda.sh [--image [--wheels DIR]]
#   (default)  `make setup` builds .venv with torch 2.14.1 from PyPI (a CUDA build; Python 3.11,
#              `python3` or PYTHON=...), then the cuda-marked tests, the parity gate with TorchAO
#              required (ci/gate.sh, compiled bench) and validate on TorchTitan's trainer.
#   --image    the machine's own CUDA torch as it is (an NGC-style image, no network needed): a
#              venv over the image's packages (.venv-image, --system-site-packages) gets only what
#              the image lacks (torchao, pluggy, tqdm, pytest, pyyaml, matplotlib), from DIR's
#              wheels with --wheels (pip --no-index: DIR must hold their dependencies too), and
#              titan-primus itself without dependencies; a Python without a CUDA torch, or with a
#              torch below 2.11, is refused in one line. Then the short check, sized for a short
#              lease: the cuda-marked tests, parity --quick with TorchAO required and bench --quick
#              (ci/gate.sh --quick). TorchTitan is not needed.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/lib.sh
export ARTIFACTS=${ARTIFACTS:-$PWD/artifacts/cuda}

usage="usage: ci/cuda.sh [--image [--wheels DIR]]"
image=0
wheels=""
while (($#)); do
    case $1 in
        --image) image=1 ;;
        --wheels) wheels=$(cd "${2:?--wheels needs a folder}" && pwd); shift ;;
        *) echo "ci/cuda.sh: unknown option '$1'; $usage" >&2; exit 2 ;;
    esac
    shift
done
if [[ -n $wheels && $image == 0 ]]; then
    echo "ci/cuda.sh: --wheels goes with --image; $usage" >&2
    exit 2
fi

if ((image)); then
    # 2.11: the oldest CUDA torch every path of this check ran on (H200, torch 2.11.0+cu130,
    # 2026-12-03: routing, the cuda tests, parity and bench); the project's floor elsewhere is 2.12
    # (TorchAO's CPU rowwise path needs it).
    "${PYTHON:-python3}" -c 'import sys
try:
    import torch
except ImportError:
    sys.exit("ci/cuda.sh --image: this Python has no torch; use the image'"'"'s Python (PYTHON=...) or ci/cuda.sh without --image")
version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if torch.version.cuda is None or version < (2, 11):
    sys.exit(f"ci/cuda.sh --image: torch {torch.__version__} is not a CUDA build of torch 2.11 or later, "
             "the oldest this check ran on; use ci/cuda.sh without --image (it installs torch 2.14.1)")'
    test -x .venv-image/bin/python || "${PYTHON:-python3}" -m venv --system-site-packages .venv-image
    export PATH="$PWD/.venv-image/bin:$PATH"
    missing=()
    for pair in torchao:torchao pluggy:pluggy tqdm:tqdm pytest:pytest yaml:pyyaml matplotlib:matplotlib; do
        python -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
    done
    source=()
    if [[ -n $wheels ]]; then source=(--no-index --find-links "$wheels"); fi
    if ((${#missing[@]})); then
        echo "== installing what the image lacks: ${missing[*]}" >&2
        # The image's torch stays: pip may add these packages' own dependencies, never replace torch.
        python -m pip list --format=freeze | grep -iE '^torch==' > .venv-image/keep.txt
        python -m pip install -q "${source[@]}" --constraint .venv-image/keep.txt "${missing[@]}"
    fi
    python -m pip install -q --no-deps --no-build-isolation -e .
else
    make setup
    export PATH="$PWD/.venv/bin:$PATH"
fi
# Elsewhere the cuda tests would only skip, and TorchAO runs on a CPU too: refused here instead.
python -c 'import sys, titan_primus as tp; d = tp.detect_device()
sys.exit(0 if d.kind == "cuda" and d.fp8_hardware else f"ci/cuda.sh: needs an NVIDIA SM89+ GPU; this is {d.arch}")'
step "cuda-marked tests (real TorchAO kernels)" python -m pytest -q -m cuda tests/unit/test_torchao_backend.py
if ((image)); then
    step "parity and bench --quick, TorchAO required" ci/gate.sh cuda --require torchao --quick
else
    step "parity gate, TorchAO required" ci/gate.sh cuda --require torchao --compile
    step "validate (FP8 vs bf16 on TorchTitan's trainer)" ci/validate.sh cuda --module llama3 --config llama3_debugmodel --steps 300
fi
echo "CUDA results: $ARTIFACTS"
finish
