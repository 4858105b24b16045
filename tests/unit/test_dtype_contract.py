"""The dtype contract (docs/recipes.md, "The dtype contract"; titan_primus.ops): a linear returns the
autocast dtype under autocast and x's dtype otherwise, on every backend, through the public op
and through both adapters' modules, exactly as nn.Linear does; a grouped GEMM returns bfloat16
whatever its inputs. And the emulation of TorchAO's recipes rounds where TorchAO rounds."""

import pytest
import torch
import torch.nn.functional as F
from support.helpers import make_offsets

import titan_primus as tp

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
AUTOCAST = [None, torch.bfloat16, torch.float16]

# (backend, device profile): every backend that runs in this process (Primus-Turbo's own code:
# tests/real_turbo/test_routing.py).
LINEAR_BACKENDS = [("emulated", "cpu"), ("emulated", "gfx942"), ("torchao", "cpu")]


def autocast(dtype):
    return torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("backend, device", LINEAR_BACKENDS, ids=lambda v: str(v))
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_linear_output_and_grad_dtypes_follow_nn_linear(backend, device, recipe):
    for x_dtype in DTYPES:
        for autocast_dtype in AUTOCAST:
            x, w, b = leaves(torch.randn(32, 64, dtype=x_dtype), torch.randn(48, 64) * 0.1, torch.randn(48))
            with autocast(autocast_dtype):
                expected = F.linear(x.detach(), w.detach().to(x_dtype), b.detach().to(x_dtype)).dtype
                if autocast_dtype is None:
                    expected = x_dtype  # F.linear needs one dtype; the op takes fp32 weights beside any x
                out = tp.fp8_linear(x, w, b, recipe=recipe, backend=backend, device=device)
            case = (x_dtype, autocast_dtype)
            assert out.dtype == expected, case
            out.backward(torch.randn_like(out))
            assert (x.grad.dtype, w.grad.dtype, b.grad.dtype) == (x_dtype, torch.float32, torch.float32), case
            assert all(torch.isfinite(t).all() for t in (out, x.grad, w.grad, b.grad)), case


@pytest.mark.parametrize("device", ["cpu", "gfx942"])
@pytest.mark.parametrize(
    "a_dtype, b_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
def test_grouped_mm_returns_bfloat16_and_grads_in_input_dtypes(device, a_dtype, b_dtype):
    offs = make_offsets([5, 0, 11])
    A, B = leaves(torch.randn(20, 32, dtype=a_dtype), torch.randn(3, 16, 32, dtype=b_dtype) * 0.1)
    for autocast_dtype in AUTOCAST:
        with autocast(autocast_dtype):
            out = tp.fp8_grouped_mm(A, B.transpose(-2, -1), offs, backend="emulated", device=device)
        assert out.dtype == torch.bfloat16, autocast_dtype
        out.backward(torch.randn_like(out))
        assert (A.grad.dtype, B.grad.dtype) == (a_dtype, b_dtype)
        A.grad = B.grad = None


def test_converted_torchtitan_model_keeps_stock_dtypes_under_autocast():
    """TorchTitan runs a single device under bf16 autocast with float32 parameters: every linear
    of the converted llama3 returns what the stock one returns (bf16), the logits included."""
    from support.titan_helpers import build, model_config

    from titan_primus.torchtitan import Float8Converter

    def linear_output_dtypes(config):
        model = build(config, seed=0)
        dtypes = {}
        for name, module in model.named_modules():
            if type(module).__name__ in ("Linear", "Fp8Linear"):
                module.register_forward_hook(lambda m, i, o, name=name: dtypes.__setitem__(name, o.dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(torch.randint(0, 2048, (1, 16)))
        return logits.dtype, dtypes

    stock = model_config("llama3")
    converted = Float8Converter.Config(device="cpu").build().convert(model_config("llama3"))
    stock_dtypes, fp8_dtypes = linear_output_dtypes(stock), linear_output_dtypes(converted)
    assert stock_dtypes[0] == fp8_dtypes[0] == torch.bfloat16
    assert stock_dtypes[1] == fp8_dtypes[1] and set(fp8_dtypes[1].values()) == {torch.bfloat16}


def run(fn, *tensors, grad):
    tensors = leaves(*tensors)
    out = fn(*tensors)
    out.backward(grad)
    return [out, *(t.grad for t in tensors)]


# TorchAO's float8 linear path (torch._scaled_mm). Its block-scaled recipes run other code, on
# other devices: tests/unit/test_block_recipes.py compares those.
@pytest.mark.parametrize("device", ["cpu", "gfx942"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("x_dtype", DTYPES)
def test_emulation_of_torchao_is_bit_identical_to_torchao(device, recipe, x_dtype):
    """TorchAO runs every GEMM with a rowwise-scaled operand in bfloat16 and casts float16/float32
    results from there, and applies tensorwise scales by their reciprocals; the emulation does
    the same, so every recipe agrees bit for bit in every dtype (outputs and all gradients).
    (Before: rowwise float32 outputs differed in rare elements, tensorwise float16/float32 in
    the last bit of many, 115-144 dB apart.)"""
    torch.manual_seed(1)
    x, w, b = torch.randn(64, 128, dtype=x_dtype), torch.randn(64, 128) * 0.05, torch.randn(64)
    grad = torch.randn(64, 64, dtype=x_dtype)
    torchao_recipe = tp.select_backend("linear", recipe, device, "torchao").recipe

    def op(backend):
        return lambda x, w, b: tp.fp8_linear(x, w, b, recipe=torchao_recipe, backend=backend, device=device)

    got = run(op("torchao"), x, w, b, grad=grad)
    emulated = run(op("emulated"), x, w, b, grad=grad)
    assert all(torch.equal(a, e) for a, e in zip(got, emulated))
