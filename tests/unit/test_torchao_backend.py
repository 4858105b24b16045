"""TorchAO's real float8 linear path (its _scaled_mm on the CPU) against the emulation of the same
TorchAO recipe, OCP and FNUZ. Shapes stay small: TorchAO's CPU path is only a reference."""

import pytest
import torch
from support.doubles import torchao_grouped_kernels
from support.helpers import Hardware, make_offsets, run_linear, sqnrs

import titan_primus as tp
from titan_primus.recipes import with_token_groups_padded_to


@pytest.mark.parametrize(
    "device, recipe",
    [(d, r) for d in ("cpu", "gfx942") for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp")]
    + [("cpu", "mxfp8")],  # TorchAO's emulated MX (its real MX kernels need SM100)
)
def test_torchao_linear_matches_emulation(device, recipe):
    x = torch.randn(2, 48, 128, dtype=torch.bfloat16)
    w = torch.randn(64, 128) * 0.05
    b = torch.randn(64)
    g = torch.randn(2, 48, 64)
    ao = tp.select_backend("linear", recipe, device, "torchao")
    got = run_linear(
        lambda x, w, b: tp.fp8_linear(x, w, b, recipe=recipe, backend="torchao", device=device), x, w, b, g
    )
    emulated = run_linear(
        lambda x, w, b: tp.fp8_linear(x, w, b, recipe=ao.recipe, backend="emulated", device=device), x, w, b, g
    )
    assert got[0].dtype == torch.bfloat16
    assert min(sqnrs(emulated, got)) >= 40, sqnrs(emulated, got)
    assert torch.backends.mkldnn.enabled  # oneDNN is off only inside the FP8 region


def test_torchao_refuses_other_definitions():
    recipe = tp.make_recipe("rowwise", "primus_turbo", tp.device_profile("gfx942"))
    with pytest.raises(tp.BackendUnavailableError, match="torchao definition"):
        tp.fp8_linear(torch.randn(4, 16), torch.randn(16, 16), recipe=recipe, backend="torchao", device="gfx942")


@pytest.mark.parametrize(
    "a_layout, b_layout",
    [("row-major", "TorchTitan's transposed view"), ("row-major", "contiguous"), ("column-major", "contiguous")],
)
def test_torchao_grouped_mm_takes_every_layout_and_copies_only_where_torchao_needs(a_layout, b_layout, monkeypatch):
    """TorchAO's rowwise grouped GEMM asserts a row-major A and a column-major B_t;
    fp8_grouped_mm takes any layout. TorchAO's own Python (asserts, autograd Function) runs on the
    kernel stand-ins of tests/support/doubles/torchao_grouped_kernels.py (its Triton kernels and
    torch._scaled_grouped_mm do not run on a CPU): TorchTitan's transposed view of its [E, N, K]
    expert weights reaches the kernels as it is, other layouts as a copy, and every layout gives
    the emulation's results (TorchAO's definition), forward and backward."""
    received = torchao_grouped_kernels.install(monkeypatch)
    decision = tp.select_backend("grouped_mm", "rowwise", "sm90", "torchao")
    recipe = with_token_groups_padded_to(decision.recipe, 16)  # as the converters say it
    offs = make_offsets([16, 0, 32, 16])  # aligned, as the converter's dispatcher pads them; one empty
    A = torch.randn(80, 64).bfloat16()  # 16 rows past the groups
    W = (torch.randn(4, 48, 64) * 0.05).bfloat16()  # [E, N, K], TorchTitan's expert weights
    grad = torch.randn(80, 48).bfloat16()
    B_t = W.transpose(-2, -1)  # [E, K, N], column-major
    leaves = [
        (A.clone() if a_layout == "row-major" else A.t().contiguous().t()).requires_grad_(),
        (B_t if b_layout.startswith("TorchTitan") else B_t.contiguous()).requires_grad_(),
    ]
    out = decision.backend.grouped_mm(*leaves, offs, recipe)
    out.backward(grad)
    got = [out, *(t.grad for t in leaves)]

    (b_quantized,) = received["triton_fp8_colwise_3d_scale_and_cast"]
    if b_layout.startswith("TorchTitan"):
        assert b_quantized.data_ptr() == W.data_ptr()  # no copy
    else:
        assert b_quantized.stride(-2) == 1 and torch.equal(b_quantized, B_t)
    assert torch.equal(out[64:], torch.zeros(16, 48, dtype=torch.bfloat16))
    # A row-major A reaches TorchAO as the caller's tensor (TorchAO saves it: one copy of the
    # tokens per call site); the stand-in GEMM leaves NaN in the trailing rows of grad_A: masked.
    a_quantized = received["triton_fp8_rowwise_2d_scale_and_cast"][0]
    assert (a_quantized.data_ptr() == leaves[0].data_ptr()) == (a_layout == "row-major")
    assert torch.equal(leaves[0].grad[64:], torch.zeros(16, 64, dtype=torch.bfloat16))
    assert [t.dtype for t in got] == [torch.bfloat16] * 3 and [t.shape for t in got[1:]] == [A.shape, (4, 64, 48)]
    emulated = [A.clone().requires_grad_(), W.clone().transpose(-2, -1).requires_grad_()]
    ref = tp.fp8_grouped_mm(*emulated, offs, recipe=decision.recipe, backend="emulated", device="sm90")
    ref.backward(grad)
    reference = [ref, *(t.grad for t in emulated)]
    assert all(t is not None for t in reference)
    assert min(sqnrs(reference, got)) >= 40, sqnrs(reference, got)  # measured: bitwise equal


def _grouped_step(backend, A, W, offs, recipe, grad):
    leaves = [A.clone().requires_grad_(), W.clone().requires_grad_()]
    out = backend.grouped_mm(leaves[0], leaves[1].transpose(-2, -1), offs, recipe)
    out.backward(grad)
    return [out, *(t.grad for t in leaves)]


def test_torchao_grouped_mm_pads_unaligned_and_empty_groups_itself(monkeypatch):
    """torch._scaled_grouped_mm needs 16-byte strides and group starts along the weight
    gradient's contraction (an H200 raised "strides should be multiple of 16 bytes" for groups of
    9, 0, 21, 6 rows and 5 trailing, K=64, N=32), and TorchAO 0.18 leaves padding to the caller.
    The backend pads each group with zero rows itself: output, grad_A and grad_B are bitwise
    those of the same groups padded by hand to 16 rows, as a padding dispatcher delivers them
    (``token_groups_padded_to``), on the kernel stand-ins, which refuse what the kernel refuses
    (next test); rows past offs[-1] get zero output and gradient."""
    torchao_grouped_kernels.install(monkeypatch)
    decision = tp.select_backend("grouped_mm", "rowwise", "sm90", "torchao")
    sizes, trailing = [9, 0, 21, 6], 5
    generator = torch.Generator().manual_seed(0)
    A = torch.randn(sum(sizes) + trailing, 64, generator=generator).bfloat16()
    W = (torch.randn(4, 32, 64, generator=generator) * 0.05).bfloat16()  # [E, N, K]
    grad = torch.randn(A.shape[0], 32, generator=generator).bfloat16()
    got = _grouped_step(decision.backend, A, W, make_offsets(sizes), decision.recipe, grad)

    # The same groups padded by hand: each group's rows first, then zero rows up to 16.
    starts, padded_starts, rows = [0], [0], []
    for size in sizes:
        rows += range(padded_starts[-1], padded_starts[-1] + size)
        starts.append(starts[-1] + size)
        padded_starts.append(padded_starts[-1] + -(-size // 16) * 16)
    where = torch.tensor(rows)
    padded_A = torch.zeros(padded_starts[-1], 64, dtype=A.dtype).index_copy(0, where, A[: starts[-1]])
    padded_grad = torch.zeros(padded_starts[-1], 32, dtype=A.dtype).index_copy(0, where, grad[: starts[-1]])
    aligned = with_token_groups_padded_to(decision.recipe, 16)
    padded_offs = torch.tensor(padded_starts[1:], dtype=torch.int32)
    expected = _grouped_step(decision.backend, padded_A, W, padded_offs, aligned, padded_grad)

    assert torch.equal(got[0][: starts[-1]], expected[0][where])
    assert torch.equal(got[1][: starts[-1]], expected[1][where])
    assert torch.equal(got[2], expected[2])
    assert not got[0][starts[-1] :].any() and not got[1][starts[-1] :].any()
    assert all(t.isfinite().all() for t in got)
    # Told the groups are padded when they are not, the backend hands them on: the stand-in
    # raises where the GPU kernel did.
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        _grouped_step(decision.backend, A, W, make_offsets(sizes), aligned, grad)


@pytest.mark.parametrize(
    "case, match",
    [
        ("41 tokens: grad_B's stride", "multiple of 16 bytes"),
        ("groups of 8 tokens along grad_B's contraction", "not multiples of 16 bytes"),
        ("mat_b row-major", "column major"),
        ("bf16 operands", "E4M3 FP8"),
        ("misaligned data pointer", "aligned to 16 bytes"),
    ],
)
def test_the_grouped_gemm_stand_in_refuses_what_the_kernel_refuses(case, match):
    """Each rule of torchao_grouped_kernels.kernel_preconditions, from the upstream source it
    cites, fails the stand-in on a CPU as it fails torch._scaled_grouped_mm on the GPU."""
    e4m3 = torch.float8_e4m3fn

    def grad_b_operands(tokens: int, offs: list[int]):
        """grad_B's GEMM as TorchAO makes it: grad_out^T [N, M] row-major @ A [M, K] column-major,
        groups along M, one scale per (group, row) and (group, column)."""
        grad_t = torch.zeros(32, tokens, dtype=e4m3)
        a = torch.zeros(48, tokens, dtype=e4m3).t()
        return [
            grad_t,
            a,
            torch.ones(32 * len(offs)),
            torch.ones(48 * len(offs)),
            torch.tensor(offs, dtype=torch.int32),
        ]

    valid = grad_b_operands(48, [16, 48])
    torchao_grouped_kernels.kernel_preconditions(*valid, torch.bfloat16)  # the valid call passes
    args = valid
    if case.startswith("41"):
        args = grad_b_operands(41, [9, 41])
    elif case.startswith("groups"):
        args = grad_b_operands(48, [8, 48])
    elif case.startswith("mat_b"):
        args[1] = args[1].contiguous()
    elif case.startswith("bf16"):
        args[0] = args[0].bfloat16()
    else:
        args[0] = torch.zeros(32 * 48 + 1, dtype=e4m3)[1:].view(32, 48)
    with pytest.raises(RuntimeError, match=match):
        torchao_grouped_kernels.scaled_grouped_mm(*args, out_dtype=torch.bfloat16)


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.cuda), "cpu"])
def torchao_hardware(request):
    """The cuda test's body on an NVIDIA SM89+ GPU (routing must take TorchAO there), and on every
    CI run on TorchAO's CPU path, asked for by name (docs/ci.md, "Hardware tests")."""
    if request.param == "cuda":
        return Hardware("cuda", tp.detect_device())
    return Hardware("cpu", tp.device_profile("cpu"), backend="torchao")


def test_torchao_on_real_fp8_gpu_matches_emulation(torchao_hardware):
    hardware = torchao_hardware
    decision = tp.select_backend("linear", "rowwise", hardware.profile, hardware.backend)
    assert decision.backend_name == "torchao", decision.explain()
    x = torch.randn(512, 1024, dtype=torch.bfloat16, device=hardware.device)
    w = torch.randn(2048, 1024, device=hardware.device) * 0.02
    g = torch.randn(512, 2048, device=hardware.device)
    got = run_linear(
        lambda x, w, b: tp.fp8_linear(x, w, b, backend=hardware.backend, device=hardware.profile), x, w, None, g
    )
    emulated = run_linear(
        lambda x, w, b: tp.fp8_linear(x, w, b, recipe=decision.recipe, backend="emulated", device=hardware.profile),
        x,
        w,
        None,
        g,
    )
    assert min(sqnrs(emulated, got)) >= 40


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_torchao_mx_linear_keeps_no_weight_copy_and_pads_only_where_needed(x_dtype):
    """TorchAO's MX linear (its emulated mode on a CPU) takes one dtype for x and the weight and
    keeps both for backward: fp32 activations come in the weight's dtype (no fp32 copy of a bf16
    weight kept), and whole 32-row blocks are not padded (the input itself is kept)."""
    from titan_primus.diagnostics.memory.saved import kept_for_backward, recording_saved_tensors

    decision = tp.select_backend("linear", "mxfp8", "cpu", "torchao")
    x = torch.randn(64, 128, dtype=x_dtype, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(96, 128, dtype=torch.bfloat16) * 0.05)
    with recording_saved_tensors() as saved:
        out = decision.backend.linear(x, w, None, decision.recipe)
    kept = kept_for_backward(saved, [w.shape], [w], rows=64, widths=(128, 96))
    assert kept["weight_copy"] == 0 and kept["parameter"] == w.numel() * 2, kept
    by_reference = any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in saved)
    assert by_reference == (x_dtype == torch.bfloat16)
    out.float().sum().backward()
    assert x.grad.dtype == x_dtype and w.grad.dtype == torch.bfloat16


def test_torchao_moe_block_keeps_the_routed_tokens_once():
    """w1 and w3 of a MoE block multiply the same routed tokens: TorchAO keeps them once (the
    caller's tensor), as stock TorchTitan does, and no weight copy."""
    from support.torchao_moe_block_memory import moe_block_kept

    result = moe_block_kept(tokens=96, dim=64, hidden=48, experts=2)
    assert result["token_copies"] == 1 and result["kept"]["weight_copy"] == 0, result


def test_a_torchao_that_moved_its_grouped_gemm_is_told_apart_from_an_old_one(monkeypatch):
    """Issue 42: with TorchAO 0.18 installed and its grouped GEMM moved, the reason used to ask for
    torchao>=0.17; it now says the symbol is missing from a TorchAO that should have it, with the
    versions verified. A TorchAO older than 0.17 still gets the install hint."""
    import torchao

    from titan_primus.backends import torchao as backend

    monkeypatch.setattr(backend, "GROUPED_MM_NAMES", (("torchao.prototype.moe_training", "_moved_upstream"),))
    why = backend.TorchAOBackend()._grouped_mm_import_error
    assert f"TorchAO {torchao.__version__} lacks its FP8 rowwise grouped GEMM" in why, why
    assert "_moved_upstream" in why and "verified on TorchAO 0.17 to 0.18" in why and ">=0.17" not in why
    monkeypatch.setattr(torchao, "__version__", "0.16.0")
    assert "pip install 'torchao>=0.17'" in backend.TorchAOBackend()._grouped_mm_import_error


@pytest.mark.parametrize(
    "op, recipe, named",
    [
        ("linear", "tensorwise", "TorchAO convert_to_float8_training"),
        ("linear", "rowwise_with_gw_hp", "TorchAO convert_to_float8_training"),
        ("linear", "mxfp8", None),
        ("grouped_mm", "rowwise", "TorchAO Float8TrainingOpConfig grouped GEMM"),
        ("grouped_mm", "tensorwise", None),
    ],
)
def test_stock_torchao_is_named_where_torchao_has_its_own_entry_point(op, recipe, named):
    backend = tp.registry.get_backend("torchao")
    stock, verdict = backend.stock_path(op, backend.recipe_for(recipe, tp.device_profile("sm90")))
    assert (stock.label if stock else None) == named and bool(verdict) == bool(named)
    assert named or recipe in verdict.reason
    assert (
        tp.registry.get_backend("emulated").stock_path(op, backend.recipe_for(recipe, tp.device_profile("cpu")))[0]
        is None
    )


def test_a_stock_torchao_symbol_that_moved_is_named(monkeypatch):
    """A TorchAO without one of STOCK_SYMBOLS: no stock path, the reason names the symbol (bench
    skips that row with it)."""
    import torchao.prototype.moe_training.utils as moe_utils

    monkeypatch.delattr(moe_utils, "_quantize_then_scaled_grouped_mm")
    backend = tp.registry.get_backend("torchao")
    stock, verdict = backend.stock_path("grouped_mm", backend.recipe_for("rowwise", tp.device_profile("sm90")))
    assert stock is None
    assert verdict.reason == "this TorchAO lacks torchao.prototype.moe_training.utils._quantize_then_scaled_grouped_mm"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_stock_torchao_linear_gives_the_torchao_backends_bits(recipe, torchao_hardware):
    """Stock TorchAO's Float8Linear (convert_to_float8_training), given the caller's weight at
    each call, against the TorchAO backend's linear on the same inputs, one forward and backward:
    on an SM89+ GPU its kernels (bench compares the same at model shapes), on every CI run
    TorchAO's CPU path with oneDNN off for both, as the backend keeps it on a CPU (which CPU
    kernel a GEMM takes is not what is compared)."""
    hardware = torchao_hardware
    backend = tp.registry.get_backend("torchao")
    made = tp.select_backend("linear", recipe, hardware.profile, hardware.backend).recipe
    stock, _ = backend.stock_path("linear", made)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=generator).bfloat16().to(hardware.device)
    w = (torch.randn(384, 512, generator=generator) * 0.05).bfloat16().to(hardware.device)
    grad = torch.randn(256, 384, generator=generator).bfloat16().to(hardware.device)
    got = []
    for forward in (stock.forward, lambda a, w, offs: backend.linear(a, w, None, made)):
        a, weight = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.backends.mkldnn.flags(enabled=False):
            out = forward(a, weight, None)
            got.append([out, *torch.autograd.grad(out, (a, weight), grad)])
    assert all(torch.equal(s, b) for s, b in zip(*got)), sqnrs(got[1], got[0])


def test_stock_torchao_grouped_gemm_gives_the_torchao_backends_bits(monkeypatch):
    """Stock TorchAO's FP8 grouped GEMM (``_quantize_then_scaled_grouped_mm`` with a default
    Float8TrainingOpConfig, as TorchTitan's FP8 MoE converter dispatches it), on TorchAO's own
    Python with its kernels stood in (tests/support/doubles/torchao_grouped_kernels.py), against
    the TorchAO backend on aligned groups, as the bench's are: bitwise."""
    torchao_grouped_kernels.install(monkeypatch)
    backend = tp.registry.get_backend("torchao")
    decision = tp.select_backend("grouped_mm", "rowwise", "sm90", "torchao")
    recipe = with_token_groups_padded_to(decision.recipe, 16)
    stock, _ = backend.stock_path("grouped_mm", decision.recipe)
    offs = make_offsets([16, 32, 16, 16])
    generator = torch.Generator().manual_seed(1)
    A = torch.randn(80, 64, generator=generator).bfloat16()
    W = (torch.randn(4, 48, 64, generator=generator) * 0.05).bfloat16()
    grad = torch.randn(80, 48, generator=generator).bfloat16()
    got = []
    for forward in (stock.forward, lambda a, w, offs: backend.grouped_mm(a, w.transpose(-2, -1), offs, recipe)):
        a, weight = A.clone().requires_grad_(), W.clone().requires_grad_()
        out = forward(a, weight, offs)
        got.append([out, *torch.autograd.grad(out, (a, weight), grad)])
    assert all(torch.equal(s, b) for s, b in zip(*got)), sqnrs(got[1], got[0])
