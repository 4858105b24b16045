"""Measure what FP8 token dispatch's definition costs per recipe (docs/token-dispatch.md).

For each recipe and 6 token distributions, the emulated grouped GEMM (4 experts, tokens 300 / 0 /
200 / 524, K = 256, N = 128) runs on the tokens and on their forward FP8 copy (what FP8 dispatch
delivers: the rowwise or 1x32 cast for the recipes that qualify; the 1x128 tile cast for
blockwise, which does not): is the forward bitwise the same, is grad_A, and how does the weight
gradient's SQNR against fp32 change. The measurement is tests/support/token_dispatch_cost.py's.

Usage (repository root): ``PYTHONPATH=. OMP_NUM_THREADS=1 python docs/token_dispatch_measure.py``
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.token_dispatch_cost import CASES, DISTRIBUTIONS, runs  # noqa: E402

from titan_primus.device import device_profile  # noqa: E402
from titan_primus.numerics import sqnr  # noqa: E402
from titan_primus.recipes import make_recipe  # noqa: E402


def main() -> None:
    for name, definition, arch in CASES:
        recipe = make_recipe(name, definition, device_profile(arch))
        for label, make in DISTRIBUTIONS.items():
            reference, tokens, copy = runs(recipe, make)
            print(
                f"{name:9s} {definition:12s} {label:8s} forward bitwise {torch.equal(tokens[0], copy[0])}, "
                f"grad_A bitwise {torch.equal(tokens[1], copy[1])}, wgrad SQNR {sqnr(reference[2], tokens[2]):6.2f} -> "
                f"{sqnr(reference[2], copy[2]):6.2f} dB"
            )


if __name__ == "__main__":
    main()
