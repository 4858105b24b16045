"""Bad input gets one clear error naming the problem and the fix, not a deep stack trace."""

import pytest
import torch
from support.helpers import make_offsets
from support.host_reads import HostReads
from torch._subclasses.fake_tensor import FakeTensorMode

import titan_primus as tp


def linear(**overrides):
    args = {"x": torch.randn(4, 32), "weight": torch.randn(16, 32), "bias": None}
    args.update(overrides)
    return tp.fp8_linear(args.pop("x"), args.pop("weight"), args.pop("bias"), **args)


def grouped(**overrides):
    args = {"A": torch.randn(10, 32), "B_t": torch.randn(2, 32, 16), "offs": make_offsets([4, 6])}
    args.update(overrides)
    return tp.fp8_grouped_mm(args.pop("A"), args.pop("B_t"), args.pop("offs"), **args)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"weight": torch.randn(2, 16, 32)}, "weight must be 2-D"),
        ({"x": torch.randn(4, 31)}, r"x's last dim \(31\) must equal weight's in_features \(32\)"),
        ({"x": torch.randint(0, 5, (4, 32))}, "x must be float32, bfloat16 or float16"),
        ({"bias": torch.randn(15)}, r"bias must have shape \(16,\)"),
        ({"recipe": "delayed"}, "unknown FP8 recipe 'delayed'; choose one of tensorwise, rowwise"),
        ({"backend": "cublas"}, "unknown FP8 backend 'cublas'"),
        ({"device": "h100"}, "unknown device profile 'h100'"),
    ],
)
def test_linear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        linear(**overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"A": torch.randn(2, 5, 32)}, "A must be 2-D"),
        ({"B_t": torch.randn(32, 16)}, "B_t must be 3-D"),
        ({"offs": make_offsets([4, 6]).long()}, "offs must be int32"),
        ({"offs": torch.tensor([6, 4], dtype=torch.int32)}, "non-decreasing"),
        (
            {"offs": torch.tensor([4, 11], dtype=torch.int32)},
            r"offs\[-1\] exceeds the number of rows of A \(10\).*got \[4, 11\]",
        ),
        ({"offs": make_offsets([4, 3, 3])}, r"one entry per expert: shape \(2,\)"),
        ({"A": torch.randn(10, 24)}, r"A's K \(24\) must equal B_t's K \(32\)"),
        ({"A": torch.randn(10, 32).to(torch.int8)}, "A must be float32, bfloat16 or float16"),
        ({"recipe": "nvfp4"}, "unknown FP8 recipe 'nvfp4'"),
    ],
)
def test_grouped_mm_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        grouped(**overrides)


def test_select_backend_rejects_unknown_op():
    with pytest.raises(ValueError, match="unknown op 'conv'"):
        tp.select_backend("conv")


def test_grouped_mm_adds_no_host_sync_on_a_gpu():
    # Fake CUDA tensors: the op runs as it would on a GPU, and any host read of one raises.
    with FakeTensorMode():
        A = torch.randn(10, 32, device="cuda", dtype=torch.bfloat16)
        B_t = torch.randn(2, 32, 16, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor([4, 6], dtype=torch.int32, device="cuda")
        with HostReads() as counted:
            out = tp.fp8_grouped_mm(A, B_t, offs, backend="emulated", device="cpu")
    assert out.shape == (10, 16)
    assert counted.host_reads == 0
    assert counted.device_asserts == 3  # the checks ran, on the device


def test_grouped_mm_checks_offsets_on_the_host_where_they_are():
    with HostReads() as counted:
        grouped()
    assert counted.host_reads == 3 and counted.device_asserts == 0
