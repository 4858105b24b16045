"""A backend never accepts at routing time a shape it cannot run: every (K, N) a backend's
supports() accepts runs forward and backward, through the op and through a converted TorchTitan
expert block. torch._grouped_mm (the emulation's grouped GEMM) needs 16-byte-aligned strides,
K and N multiples of 8 in bfloat16; the emulation pads what is not."""

import pytest
import torch
from support.helpers import bars, make_offsets, reference_grouped, run_grouped, run_linear, sqnrs

import titan_primus as tp

# K and N around multiples of 8 and 16.
DIMS = [(8, 8), (7, 9), (12, 16), (16, 12), (15, 17), (24, 20), (32, 48)]


def supported(op, backend, device, k, n):
    impl = tp.registry.get_backend(backend)
    return (
        impl.availability(tp.device_profile(device)).ok
        and impl.supports(op, "rowwise", tp.device_profile(device), k=k, n=n).ok
    )


@pytest.mark.parametrize("device", ["cpu", "gfx942"])
@pytest.mark.parametrize("k, n", DIMS)
def test_emulated_grouped_mm_runs_every_shape_it_accepts(device, k, n):
    assert supported("grouped_mm", "emulated", device, k, n)
    counts, trailing = [3, 0, 9, 5], 2
    offs = make_offsets(counts)
    A = torch.randn(sum(counts) + trailing, k, dtype=torch.bfloat16)
    W = (torch.randn(len(counts), n, k) * 0.2).bfloat16()
    g = torch.randn(A.shape[0], n)
    got = run_grouped(
        lambda A, B_t, offs: tp.fp8_grouped_mm(A, B_t, offs, backend="emulated", device=device), A, W, offs, g
    )
    out, grad_A, grad_W = got
    assert (out.shape, grad_A.shape, grad_W.shape) == ((A.shape[0], n), A.shape, W.shape)
    assert torch.equal(out[-trailing:], torch.zeros_like(out[-trailing:]))
    assert torch.equal(grad_W[1], torch.zeros_like(grad_W[1]))  # the empty expert
    assert min(sqnrs(reference_grouped(A, W, offs, g), got)) >= min(bars("rowwise")) - 3  # tiny K: fewer terms


def test_padding_changes_no_result():
    """An unaligned problem padded by the emulation equals the same problem zero-padded by hand
    to an aligned one and cut back: zeros change no amax and add nothing."""
    offs = make_offsets([6, 10])
    A = torch.randn(16, 12, dtype=torch.bfloat16)
    W = torch.randn(2, 20, 12, dtype=torch.bfloat16)
    g = torch.randn(16, 20)

    def op(A, B_t, offs):
        return tp.fp8_grouped_mm(A, B_t, offs, backend="emulated", device="cpu")

    got = run_grouped(op, A, W, offs, g)
    padded = run_grouped(
        op,
        torch.nn.functional.pad(A, (0, 4)),
        torch.nn.functional.pad(W, (0, 4, 0, 4)),
        offs,
        torch.nn.functional.pad(g, (0, 4)),
    )
    expected = [padded[0][:, :20], padded[1][:, :12], padded[2][:, :20, :12]]
    assert all(torch.equal(a, e) for a, e in zip(got, expected))


# Primus-Turbo's: tests/real_turbo/test_routing.py, on its own code.
# (backend, device): the (K, N) of LINEAR_DIMS it must accept (TorchAO's _scaled_mm: K and N
# multiples of 16; the emulation: any); the rest it must refuse.
LINEAR_DIMS = DIMS + [(256, 16), (512, 32)]
ACCEPTED = {
    ("emulated", "cpu"): LINEAR_DIMS,
    ("torchao", "cpu"): [(32, 48), (256, 16), (512, 32)],
}


@pytest.mark.parametrize("backend, device", list(ACCEPTED), ids=lambda v: str(v))
def test_every_linear_shape_a_backend_accepts_runs(backend, device):
    accepted = [(k, n) for k, n in LINEAR_DIMS if supported("linear", backend, device, k, n)]
    assert accepted == ACCEPTED[backend, device]
    for k, n in accepted:
        x, w, g = torch.randn(16, k, dtype=torch.bfloat16), torch.randn(n, k) * 0.1, torch.randn(16, n)
        out, grad_x, grad_w, _ = run_linear(
            lambda x, w, b: tp.fp8_linear(x, w, b, backend=backend, device=device), x, w, None, g
        )
        assert all(torch.isfinite(t).all() for t in (out, grad_x, grad_w)), (k, n)


@pytest.mark.parametrize("dim, hidden_dim", [(20, 12), (36, 44), (15, 17)])
def test_converted_expert_block_with_unaligned_dims_trains(dim, hidden_dim):
    """Through the converter: TorchTitan 0.3 GroupedExperts whose dims are not multiples of 8
    route to the emulation (it accepts them) and then run, forward and backward."""
    from torchtitan.models.common.moe import GroupedExperts

    from titan_primus.torchtitan import Float8Converter

    stock = GroupedExperts.Config(dim=dim, hidden_dim=hidden_dim, num_experts=4)
    converter = Float8Converter.Config(device="cpu").build()
    config = converter.convert(stock)
    assert [r.backend for r in converter.report.layers] == ["emulated"]
    experts = config.build()
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    x = torch.randn(30, dim, requires_grad=True)
    out = experts(x, torch.tensor([7, 0, 13, 10]))
    out.backward(torch.randn_like(out))
    assert out.shape == (30, dim) and torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in experts.parameters())
