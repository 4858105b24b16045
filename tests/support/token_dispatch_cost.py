"""What FP8 token dispatch's definition costs per recipe (docs/token-dispatch.md): the
measurement behind the figures in the refusals of titan_primus/recipes.py, which
tests/distributed/test_token_dispatch.py recomputes and docs/token_dispatch_measure.py prints.

For each recipe and 6 token distributions, the emulated grouped GEMM (4 experts, tokens 300 / 0 /
200 / 524, K = 256, N = 128) runs on the tokens and on their forward FP8 copy (what FP8 dispatch
delivers: the rowwise or 1x32 cast for the recipes that qualify; the 1x128 tile cast for
blockwise, which does not): is the forward bitwise the same, is grad_A, and how does the weight
gradient's SQNR against fp32 change.
"""

import torch

from titan_primus.fp8 import blocks
from titan_primus.backends.emulated import EmulatedBackend
from titan_primus.numerics import make_offsets, reference_grouped, run_grouped, sqnr
from titan_primus.token_dispatch import DispatchCast, fp8_copy

DISTRIBUTIONS = {
    "normal": lambda s: torch.randn(s),
    "heavy": lambda s: torch.randn(s) * torch.exp(2 * torch.randn(s[0], 1)),
    "laplace": lambda s: torch.distributions.Laplace(0, 1).sample(s),
    "outliers": lambda s: torch.randn(s) * (1 + 30 * (torch.rand(s) < 0.001)),
    "tiny": lambda s: torch.randn(s) * 1e-3,
    "wide": lambda s: torch.randn(s) * torch.exp(4 * torch.randn(s)),
}
COUNTS = [300, 0, 200, 524]
_EMULATED = EmulatedBackend()
CASES = [
    ("rowwise", "torchao", "sm90"),
    ("rowwise", "primus_turbo", "gfx942"),
    ("mxfp8", "torchao", "sm100"),
    ("mxfp8", "primus_turbo", "gfx950"),
    ("blockwise", "torchao", "sm90"),
    ("blockwise", "primus_turbo", "gfx942"),
]


def forward_copy(A: torch.Tensor, recipe) -> torch.Tensor:
    """The tokens as the recipe's forward activation cast leaves them, dequantized."""
    cast = recipe.output.a
    if cast.granularity == "block" and recipe.block_scale.kind == "fp32":
        cells = blocks.cells_of(tuple(A.shape), cast.block, A.device)
        data, scale_inv = blocks.quantize_blocks(A, recipe.dtype(cast), recipe.block_scale, cells)
        return blocks.dequantize(data, scale_inv, cells).to(A.dtype)
    mx_rule = recipe.block_scale if cast.granularity == "block" else None
    return fp8_copy(A, DispatchCast(recipe.dtype(cast), recipe.pow2_scales, recipe.reciprocal_scales, mx_rule))


def runs(recipe, make):
    """(fp32 reference, on the tokens, on their forward copy): each the grouped GEMM's output,
    grad_A and weight gradient, for tokens drawn by ``make``."""
    torch.manual_seed(1)
    offs = make_offsets(COUNTS)
    A = make((sum(COUNTS), 256)).bfloat16()
    W = (torch.randn(4, 128, 256) * 0.05).bfloat16()
    grad = torch.randn(sum(COUNTS), 128).bfloat16()

    def gemm(a, b, o):
        return _EMULATED.grouped_mm(a, b, o, recipe)

    return (
        reference_grouped(A, W, offs, grad),
        run_grouped(gemm, A, W, offs, grad),
        run_grouped(gemm, forward_copy(A, recipe), W, offs, grad),
    )


def wgrad_losses(recipe) -> dict[str, float]:
    """Per distribution, the dB of weight-gradient SQNR against fp32 lost from the tokens to
    their forward copy."""
    losses = {}
    for label, make in DISTRIBUTIONS.items():
        reference, tokens, copy = runs(recipe, make)
        losses[label] = sqnr(reference[2], tokens[2]) - sqnr(reference[2], copy[2])
    return losses
