"""Every custom op titan-primus registers is a well-formed one (``torch.library.opcheck``: schema,
fake implementation, autograd registration, AOT dispatch), so torch.compile and selective
activation checkpointing see what eager runs. The emulated backend's ops here; Primus-Turbo's
wrappers on its own code in the tier (tests/real_turbo)."""

import pytest
import torch
from support.custom_ops import WITHOUT_FP8_ARITHMETIC, defined_ops, no_output_aliases_an_input

import titan_primus.backends.emulated.attention  # noqa: F401  (registers its ops)
import titan_primus.backends.emulated.gemm_ops  # noqa: F401

OPS = torch.ops.titan_primus


def _randn(*shape, dtype=torch.float32, grad=False, seed=0):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return t.requires_grad_() if grad else t


# The GEMM ops have no autograd of their own: the backends' autograd Functions call them, forward
# and backward, on operands that do not require grad.
GEMMS = {
    "mm": (OPS.emulated_fp8_mm.default, lambda: (_randn(32, 64), _randn(64, 48, seed=1))),
    "grouped_mm-3d": (
        OPS.emulated_fp8_grouped_mm.default,
        lambda: (_randn(48, 64), _randn(3, 64, 32, seed=1), torch.tensor([16, 32, 48], dtype=torch.int32)),
    ),
    "grouped_mm-2d": (
        OPS.emulated_fp8_grouped_mm.default,
        lambda: (_randn(64, 48), _randn(48, 32, seed=1), torch.tensor([16, 32, 48], dtype=torch.int32)),
    ),
    # The block casts (blockwise's 128x128 fp32 scales, TorchAO MX's 1x32 E8M0), on a transposed
    # view as the wgrad casts it: the output is contiguous whatever the input's layout.
    "block_cast-128x128": (
        OPS.emulated_block_cast.default,
        lambda: (_randn(200, 300).t(), torch.float8_e4m3fn, 128, 128, "fp32", 1e-4, False, ""),
    ),
    "block_cast-1x32-experts": (
        OPS.emulated_block_cast.default,
        lambda: (_randn(3, 40, 64, dtype=torch.bfloat16), torch.float8_e4m3fn, 1, 32, "e8m0", 0.0, False, "rceil"),
    ),
}


@pytest.mark.parametrize("case", GEMMS)
def test_emulated_gemms_are_well_formed(case):
    op, make = GEMMS[case]
    torch.library.opcheck(op, make())


def _attention_inputs():
    B, L, Hq, Hkv, D = 1, 128, 4, 2, 64
    q, k, v = (_randn(B, L, h, D, dtype=torch.bfloat16, grad=True, seed=i) for i, h in enumerate((Hq, Hkv, Hkv)))
    return q, k, v


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_emulated_attention_ops_are_well_formed(causal):
    q, k, v = _attention_inputs()
    forward = OPS.emulated_fp8_attention_forward.default
    args = (q, k, v, causal, 0.125, torch.float8_e4m3fn)
    no_output_aliases_an_input(forward, args)
    torch.library.opcheck(forward, args, test_utils=WITHOUT_FP8_ARITHMETIC)
    out, *saved = (t.detach() for t in forward(*args))
    backward = OPS.emulated_fp8_attention_backward.default
    back_args = (_randn(*out.shape, dtype=torch.bfloat16, seed=5), *saved[:6], out, saved[6], causal, 0.125)
    no_output_aliases_an_input(backward, back_args)
    torch.library.opcheck(backward, back_args, test_utils=WITHOUT_FP8_ARITHMETIC)


def test_every_op_defined_without_primus_turbo_is_checked_here():
    """A new custom op fails this until it has an opcheck above (Primus-Turbo's: the tier)."""
    attention = (OPS.emulated_fp8_attention_forward.default, OPS.emulated_fp8_attention_backward.default)
    checked = {op.name() for op, _ in GEMMS.values()} | {op.name() for op in attention}
    without_turbo = {name for name in defined_ops() if "primus_turbo" not in name}
    assert without_turbo == checked, without_turbo ^ checked
