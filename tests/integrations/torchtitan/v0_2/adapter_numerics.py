"""The 0.2 adapter's modules against the shared ops on the same weights and inputs, as checks of
one backend, device profile and recipe: tests/integrations/torchtitan/v0_2/test_numerics.py runs them on the emulation,
tests/integrations/torchtitan/v0_2/real_turbo/test_adapter.py on Primus-Turbo's own code.

The 0.3 path is the shared core: the 0.3 adapter's modules call the same backends with the same
recipes that ``titan_primus.fp8_linear`` and ``titan_primus.fp8_grouped_mm`` route to, on the
operands TorchTitan 0.3's ``GroupedExperts.forward`` passes (bf16 A, transposed bf16 weights,
int32 end offsets). TorchTitan 0.3 cannot be installed beside 0.2, so those public ops stand in
for it here. Both sides run the same backend code on the same bits, so forward outputs and every
gradient must be bitwise equal (and finite); but for blockwise experts with padded token groups,
where padding changes the shapes of the block GEMMs and so their fp32 accumulation order.
"""

import torch
import torch.nn.functional as F
import torchtitan.models.moe.utils as moe_utils
from support.closeness import assert_bitwise, assert_sqnr_at_least
from tt02_helpers import convert, materialize, meta_model

import titan_primus as tp
from titan_primus.torchtitan02 import Fp8GroupedExperts, Fp8Linear

# (backend, device profile, recipe): the emulation under both recipe definitions (torchao on
# cpu, Primus-Turbo's on MI300-class profiles); Primus-Turbo itself: tests/integrations/torchtitan/v0_2/real_turbo.
CASES = [
    ("emulated", "cpu", "tensorwise"),
    ("emulated", "cpu", "rowwise"),
    ("emulated", "cpu", "rowwise_with_gw_hp"),
    ("emulated", "gfx942", "tensorwise"),
    ("emulated", "gfx942", "rowwise"),
    ("emulated", "cpu", "mxfp8"),
    ("emulated", "gfx950", "mxfp8"),
    ("emulated", "cpu", "blockwise"),
    ("emulated", "gfx942", "blockwise"),
]

# Blockwise experts on padded token groups against the ragged shared op: the block GEMMs' fp32
# accumulation order, in grad_input (measured 2026-12-02: 110.6 dB on the cpu profile, 128.7 dB
# on gfx942; output and the weight gradients bitwise equal but gfx942's grad w3); and where that
# order flips a bf16 rounding of the gradient that w3's weight gradient casts along the tokens,
# an FP8 rounding or a 128-token tile's scale moves with it (gfx942's grad w3: 217 of 524,288
# elements, 76.4 dB). Bounds: 10 dB under the lowest grad_input, 6 dB (4x the error) under the
# weight gradient's: a padding row inside a tile's amax or groups off their rows are FP8 noise,
# about 30 dB.
PADDED_BLOCKWISE_MIN_DB = 100.0
PADDED_BLOCKWISE_WEIGHT_GRAD_MIN_DB = 70.0

# Unaligned groups, empty groups (first, middle, last): what TorchTitan's router hands experts;
# and those of an EP rank whose experts receive no token.
TOKENS_PER_EXPERT = {"routed": [0, 5, 17, 0, 3, 9, 13, 0], "no token": [0] * 8}


def converted_module(model_name: str, fqn: str, backend: str, device: str, recipe: str):
    model = meta_model(model_name)
    convert(model, backend=backend, device=device, recipe=recipe, strict=True)
    return materialize(model).get_submodule(fqn)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def fp8_linear_matches_the_shared_op(backend, device, recipe):
    module = converted_module("llama3", "layers.0.feed_forward.w1", backend, device, recipe)
    assert isinstance(module, Fp8Linear)
    x = torch.randn(2, 24, module.in_features)

    x1 = leaf(x)
    out = module(x1)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    x2, w2 = leaf(x), leaf(module.weight)
    ref = tp.fp8_linear(x2, w2, None, recipe=recipe, backend=backend, device=device)
    ref.backward(grad_out)

    assert_bitwise(ref, out, "output")
    assert_bitwise(x2.grad, x1.grad, "grad_input")
    assert_bitwise(w2.grad, module.weight.grad, "grad_weight")


def reference_experts(x, w1, w2, w3, offs, **op):
    """TorchTitan 0.3's GroupedExperts.forward with its _grouped_mm seam on titan_primus."""

    def grouped_mm(A, w):
        return tp.fp8_grouped_mm(A, w.bfloat16().transpose(-2, -1), offs, **op)

    h = F.silu(grouped_mm(x.bfloat16(), w1)) * grouped_mm(x.bfloat16(), w3)
    return grouped_mm(h, w2).type_as(x)


def fp8_experts_match_the_shared_op(backend, device, recipe, pad_token_groups, tokens):
    """Ragged groups, as routed for the emulation and Primus-Turbo; padded to 16, as routed for
    TorchAO (forced here, since TorchAO's grouped GEMM has no CPU kernel): padding is exact (bitwise
    but for blockwise: PADDED_BLOCKWISE_MIN_DB and PADDED_BLOCKWISE_WEIGHT_GRAD_MIN_DB). Experts
    that receive no token: an empty output and zero weight gradients, as the shared op's."""
    experts = converted_module("deepseek_v3", "layers.1.moe.experts", backend, device, recipe)
    assert isinstance(experts, Fp8GroupedExperts)
    if pad_token_groups:
        experts.pad_token_groups = True
        moe_utils.set_token_group_alignment_size_m(16)
    counts = torch.tensor(TOKENS_PER_EXPERT[tokens])
    x = torch.randn(int(counts.sum()), experts.w1.shape[2])

    x1 = leaf(x)
    out = experts(x1, counts)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    x2, w1, w2, w3 = (leaf(t) for t in (x, experts.w1, experts.w2, experts.w3))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    ref = reference_experts(x2, w1, w2, w3, offs, recipe=recipe, backend=backend, device=device)
    ref.backward(grad_out)

    def check(expected, actual, what, min_db=PADDED_BLOCKWISE_MIN_DB):
        if pad_token_groups and recipe == "blockwise" and tokens == "routed":
            assert_sqnr_at_least(expected, actual, min_db, what)
        else:
            assert_bitwise(expected, actual, what)

    check(ref, out, "output")
    check(x2.grad, x1.grad, "grad_input")
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        grad = getattr(experts, name).grad
        check(w.grad, grad, f"grad {name}", PADDED_BLOCKWISE_WEIGHT_GRAD_MIN_DB)
        if tokens == "no token":
            assert torch.equal(grad, torch.zeros_like(grad)), name
