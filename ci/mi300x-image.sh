#!/usr/bin/env bash
# The MI300X CI inside AMD's image (rocm/primus: torch with ROCm, torchao, Primus-Turbo, TorchTitan
# 0.2.x); ci/mi300x.sh starts it with Docker, or run it in the image from a checkout. On a copy of
# the checkout, titan-primus is installed into the image's Python as it is, with the TorchTitan 0.2.x
# adapter (the line AMD Primus pins): the image's own builds become pip constraints, so pip refuses
# a requirement they do not meet instead of replacing them, and afterwards every one of them must
# still be there, unchanged. Then the mi300-marked tests, the TorchTitan 0.2.x suite on the image's
# stack, the parity gate with Primus-Turbo required (ci/gate.sh; its parity and bench include FP8 and
# bf16 attention on Primus-Turbo's kernels) and the upgrade gate on TorchTitan
# 0.2.x's trainer (ci/validate.sh: validate-mi300x.json, .md, .png). Results go to $ARTIFACTS
# (default artifacts/mi300x in the checkout). Every step after the install runs; the script fails at
# the end if any did.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=ci/lib.sh
source "$src/ci/lib.sh"
export ARTIFACTS=${ARTIFACTS:-$src/artifacts/mi300x}
mkdir -p "$ARTIFACTS"
# pip builds beside the sources, and ci/mi300x.sh mounts the checkout read-only: a copy is used.
work=$(mktemp -d)
# The results belong to whoever started the container (ci/mi300x.sh passes OWNER=uid:gid).
cleanup() {
    rm -rf "$work"
    if [[ -n ${OWNER:-} ]]; then chown -R "$OWNER" "$ARTIFACTS"; fi
}
trap cleanup EXIT
tar -C "$src" --exclude=./.git --exclude='./.venv*' --exclude=./artifacts -cf - . | tar -C "$work" -xf -
cd "$work"

# The image's ROCm stack, by distribution name (pytorch-triton-rocm provides the triton module).
stack="^(torch|torchao|triton|pytorch-triton-rocm|torchtitan|primus[-_]turbo)=="
python -m pip list --format=freeze | grep -iE "$stack" | tee "$ARTIFACTS/image-stack.txt"
python -m pip install -e ".[test,torchtitan02]" --constraint "$ARTIFACTS/image-stack.txt"
python -m pip list --format=freeze | grep -Fxf "$ARTIFACTS/image-stack.txt" | diff "$ARTIFACTS/image-stack.txt" -
# Elsewhere the mi300 tests would only skip: refused here instead.
python -c 'import sys, titan_primus as tp; d = tp.detect_device()
sys.exit(0 if d.mi300_class else f"ci/mi300x-image.sh: needs an MI300-class GPU visible here; this is {d.arch}")'

# The tests/ modules that import TorchTitan 0.3 cannot be collected beside the image's 0.2.x: the
# files holding mi300 tests are named (tests/unit/test_cli_ci.py checks that none is left out).
step "mi300-marked tests (real Primus-Turbo kernels)" \
    python -m pytest -q -m mi300 tests/unit/test_mi300_*.py
step "the TorchTitan 0.2.x suite on the image's stack" python -m pytest -q tests/integrations/torchtitan
step "parity gate, Primus-Turbo required" ci/gate.sh mi300x --require primus_turbo --compile
# The gate's parity and bench hold attention too: FP8 attention against fp32 SDPA and the emulation,
# and Llama3-8B / DeepSeek-V3 attention timed in bf16 (SDPA, Primus-Turbo's flash_attn_func) and FP8
# (Primus-Turbo's FP8 attention). Refused here if any Primus-Turbo attention row was skipped.
step "Primus-Turbo attention ran in parity and bench" python -c 'import json, sys
rows = [r for kind in ("parity", "bench") for r in json.load(open(f"{sys.argv[1]}/{kind}-mi300x.json"))["results"]]
skipped = [r["case"] + " " + r["recipe"] + ": " + r["reason"] for r in rows
           if r["op"] == "attention" and r["backend"] == "primus_turbo" and r["status"] == "skipped"]
sys.exit("Primus-Turbo attention did not run: " + "; ".join(skipped) if skipped else 0)' "$ARTIFACTS"
step "validate (FP8 vs bf16 on TorchTitan 0.2.x's trainer)" \
    ci/validate.sh mi300x --config examples/torchtitan02/llama3_debug_fp8.toml --steps 300
# The attention route (docs/attention.md): deepseek_v3's SDPA-causal layers on Primus-Turbo, in
# FP8 where the definition holds (MLA head dims 192/128), the FP8 runs against bf16 as above.
step "validate with attention on Primus-Turbo (bf16 and FP8 attention)" \
    ci/validate.sh mi300x-attention --config examples/torchtitan02/deepseek_v3_debug_fp8.toml --steps 300 \
    --attention --fp8-attention
finish
