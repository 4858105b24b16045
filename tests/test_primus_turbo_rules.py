"""Each Primus-Turbo kernel limit, per recorded release, on gfx942 and gfx950 profiles: the TEST
DOUBLE enforces it (as the kernels do; tests/doubles/ cites the upstream files) and the adapter
either stays within it or routes the op elsewhere with the reason. Not evidence about the real
kernels: tests/test_mi300_primus_turbo.py runs the same cases on an MI300-class GPU."""

import importlib

import pytest
import torch
from doubles import primus_turbo_double
from helpers import make_offsets, run_grouped, run_linear

import titan_primus as tp
from titan_primus.backends.primus_turbo import OPS_MODULE, load_api

VERSIONS = primus_turbo_double.VERSIONS
ARCHS = ["gfx942", "gfx950"]


def install(monkeypatch, version, arch="gfx942"):
    api = primus_turbo_double.install(monkeypatch, version=version, arch=arch)
    tp.registry.refresh()
    return api


def turbo_linear(recipe, arch):
    decision = tp.select_backend("linear", recipe, arch, "primus_turbo")
    return lambda x, w, b: decision.backend.linear(x, w, b, decision.recipe)


def turbo_grouped(recipe, arch):
    decision = tp.select_backend("grouped_mm", recipe, arch, "primus_turbo")
    return lambda A, B_t, offs: decision.backend.grouped_mm(A, B_t, offs, decision.recipe)


def fp8(t, dtype=torch.float8_e4m3fnuz):
    return t.to(dtype)


# ---- 16-bit output ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_the_kernels_write_16_bit_output_only(version, monkeypatch):
    install(monkeypatch, version)
    turbo = importlib.import_module(OPS_MODULE)
    x, w = torch.randn(32, 64), torch.randn(32, 64)
    error = ValueError if version != "v0.2.0" else RuntimeError  # dispatcher (v0.3.0+) vs C++ check
    with pytest.raises(error, match="No compatible backend|kBFloat16 or kHalf"):
        turbo.ops.gemm_fp8(x, w, trans_b=True, out_dtype=torch.float32)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp32_activations_keep_their_dtype(version, arch, recipe, monkeypatch):
    """fp32 x: the kernels write bf16, returned upcast to fp32 (TorchAO's rowwise GEMM rounds through
    bf16 too); gradients come back in the inputs' dtypes."""
    install(monkeypatch, version, arch)
    if version == "v0.2.0" and recipe == "tensorwise":
        pytest.skip("tensorwise is refused at v0.2.0 (test_primus_turbo_adapter.py)")
    fn = turbo_linear(recipe, arch)
    x, w = torch.randn(64, 256), torch.randn(128, 256) * 0.05
    out, grad_x, grad_w = run_linear(fn, x, w, None, torch.randn(64, 128))[:3]
    assert (out.dtype, grad_x.dtype, grad_w.dtype) == (torch.float32,) * 3
    assert all(torch.isfinite(t).all() for t in (out, grad_x, grad_w))
    assert torch.equal(out, out.bfloat16().float())  # a bf16 result, upcast
    assert run_linear(fn, x.bfloat16(), w, None, torch.randn(64, 128))[0].dtype == torch.bfloat16


# ---- CK's K % 32 for rowwise dense GEMMs ---------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_ck_alignment_of_rowwise_dense_gemms(version, monkeypatch):
    install(monkeypatch, version)
    turbo = importlib.import_module(OPS_MODULE)
    config = load_api().configs["rowwise"]
    x, w = torch.randn(32, 48, dtype=torch.bfloat16, requires_grad=True), torch.randn(48, 48, requires_grad=True)
    decision = tp.select_backend("linear", "rowwise", "gfx942", k=48, n=64)
    if version == "v0.4.0":  # Triton: no such limit
        turbo.ops.gemm_fp8(x, w, trans_b=True, out_dtype=torch.bfloat16, config=config).sum().backward()
        assert decision.backend_name == "primus_turbo"
        return
    # The kernel refuses it (forward K=48 at v0.3.x; v0.2.0 pads K, its dgrad over N=48 fails).
    with pytest.raises(RuntimeError, match="k must be a multiple of 32, got k=48"):
        turbo.ops.gemm_fp8(x, w, trans_b=True, out_dtype=torch.bfloat16, config=config).sum().backward()
    if version == "v0.2.0":
        assert decision.backend_name == "primus_turbo"  # K padded; N = 64 is fine
        decision = tp.select_backend("linear", "rowwise", "gfx942", k=64, n=48)
    assert decision.backend_name != "primus_turbo"
    assert "CK" in dict(decision.passed_over)["primus_turbo"] and "32" in dict(decision.passed_over)["primus_turbo"]
    assert tp.select_backend("linear", "rowwise", "gfx942", k=64, n=96).backend_name == "primus_turbo"
    if version != "v0.2.0":  # tensorwise runs on hipBLASLt, which has no such rule
        assert tp.select_backend("linear", "tensorwise", "gfx942", k=48, n=48).backend_name == "primus_turbo"


# ---- Triton grouped GEMMs: contraction dims >= 256 -----------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_small_k_grouped_gemm_routes_elsewhere(version, monkeypatch):
    install(monkeypatch, version)
    turbo = importlib.import_module(OPS_MODULE)
    config = load_api().configs["rowwise"]
    A, W = torch.randn(40, 128, dtype=torch.bfloat16), torch.randn(2, 256, 128, dtype=torch.bfloat16)
    lens = torch.tensor([30, 10])
    small = tp.select_backend("grouped_mm", "rowwise", "gfx942", k=128, n=256)
    small_n = tp.select_backend("grouped_mm", "rowwise", "gfx942", k=256, n=128)
    if version in ("v0.2.0", "v0.3.0"):  # CK grouped kernels
        assert torch.isfinite(turbo.ops.grouped_gemm_fp8(A, W, lens, config=config)).all()
        assert small.backend_name == small_n.backend_name == "primus_turbo"
        return
    with pytest.raises(RuntimeError, match="loop_k > 1"):
        turbo.ops.grouped_gemm_fp8(A, W, lens, out_dtype=torch.bfloat16, config=config)
    for decision in (small, small_n):
        assert decision.backend_name != "primus_turbo"
        assert "loop_k > 1" in dict(decision.passed_over)["primus_turbo"]
    assert tp.select_backend("grouped_mm", "rowwise", "gfx942", k=256, n=256).backend_name == "primus_turbo"


# ---- rows past the groups --------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_tail_rows_unwritten_before_v040_and_zero_after(version, monkeypatch):
    install(monkeypatch, version)
    turbo = importlib.import_module(OPS_MODULE)
    config = load_api().configs["rowwise"]
    A, W = torch.randn(50, 256, dtype=torch.bfloat16), torch.randn(2, 256, 256, dtype=torch.bfloat16)
    extra = {"out_dtype": torch.bfloat16} if version >= "v0.3.1" else {}
    out = turbo.ops.grouped_gemm_fp8(A, W, torch.tensor([30, 10]), config=config, **extra)
    tail = out[40:]
    assert (tail == 0).all() if version == "v0.4.0" else tail.isnan().all()
    # Through the adapter nothing unwritten escapes, at every release.
    offs = make_offsets([30, 10])
    got = run_grouped(turbo_grouped("rowwise", "gfx942"), A, W.transpose(-2, -1), offs, torch.randn(50, 256))
    assert all(torch.isfinite(t).all() for t in got)
    assert (got[0][40:] == 0).all() and (got[1][40:] == 0).all()


# ---- v0.3.0's tensorwise grouped backward ----------------------------------------------------------


def test_v030_tensorwise_grouped_is_refused(monkeypatch):
    install(monkeypatch, "v0.3.0")
    turbo = importlib.import_module(OPS_MODULE)
    A = torch.randn(40, 256, dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(2, 256, 256, dtype=torch.bfloat16)
    out = turbo.ops.grouped_gemm_fp8(A, W, torch.tensor([30, 10]), config=load_api().configs["tensorwise"])
    with pytest.warns(UserWarning, match="fallback backend HIPBLASLT"):
        out.sum().backward()
    # No other backend runs tensorwise grouped GEMMs on gfx942: refused with the reason.
    with pytest.raises(tp.BackendUnavailableError, match="primus_turbo: Primus-Turbo v0.3.0 .* hipBLASLt"):
        tp.select_backend("grouped_mm", "tensorwise", "gfx942")
    assert tp.select_backend("linear", "tensorwise", "gfx942").backend_name == "primus_turbo"


# ---- per-call waste: group_offs passed, B_t taken without a copy ------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("layout", ["transposed_view", "contiguous"])
def test_grouped_call_passes_offsets_and_avoids_copies(version, layout, monkeypatch):
    api = install(monkeypatch, version)
    offs = make_offsets([20, 0, 12])
    A = torch.randn(32, 256, dtype=torch.bfloat16)
    weights = torch.randn(3, 256, 256, dtype=torch.bfloat16)  # [E, N, K]
    B_t = weights.transpose(-2, -1) if layout == "transposed_view" else weights.transpose(-2, -1).contiguous()
    seen = []
    real = primus_turbo_double._GroupedGemm.forward

    def spy(ctx, a, b, group_lens, group_offs, trans_b, *rest):
        seen.append((b.data_ptr(), trans_b, group_offs.tolist()))
        return real(ctx, a, b, group_lens, group_offs, trans_b, *rest)

    monkeypatch.setattr(primus_turbo_double._GroupedGemm, "forward", staticmethod(spy))
    turbo_grouped("rowwise", "gfx942")(A, B_t, offs)
    kwargs = api.call_kwargs[-1]
    assert kwargs["group_offs"].tolist() == [0, 20, 20, 32]
    b_ptr, trans_b, _ = seen[-1]
    assert trans_b == (layout == "transposed_view")
    assert b_ptr == B_t.data_ptr()  # no copy


# ---- the double's errors ---------------------------------------------------------------------------


def test_double_rejects_what_the_kernels_reject(monkeypatch):
    install(monkeypatch, "v0.4.0")
    ops = primus_turbo_double._low_level_ops("v0.4.0")
    a = fp8(torch.randn(32, 256))
    b = fp8(torch.randn(2, 256, 256))
    s = torch.ones(())
    lens, goffs = torch.tensor([20, 12]), torch.tensor([0, 20, 32])
    with pytest.raises(RuntimeError, match="kLong"):
        ops.grouped_gemm_fp8_impl(a, b, s, s, lens.int(), goffs, False, True, torch.bfloat16, 1, None, 4)
    with pytest.raises(RuntimeError, match="dense layouts"):
        ops.grouped_gemm_fp8_impl(a, b.transpose(-2, -1), s, s, lens, goffs, False, True, torch.bfloat16, 1, None, 4)
    with pytest.raises(ValueError, match="No compatible backend"):
        ops.grouped_gemm_fp8_impl(a, b, s, s, lens, goffs, False, True, torch.float32, 1, None, 4)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.primus_turbo_cpp_extension.quantize_fp8_rowwise(torch.randn(8, 4).t(), torch.float8_e4m3fnuz, -1)


def test_dequantize_rowwise_does_not_exist_before_v031(monkeypatch):
    install(monkeypatch, "v0.3.0")
    q, s = torch.ops.primus_turbo_cpp_extension.quantize_fp8_rowwise(torch.randn(4, 8), torch.float8_e4m3fnuz, -1)
    with pytest.raises(AttributeError, match="v0.3.1"):
        torch.ops.primus_turbo_cpp_extension.dequantize_fp8_rowwise(q, s, -1, torch.bfloat16)


# ---- doctor ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("version, compiled", [("v0.2.0", "re-runs the forward"), ("v0.3.0", "low-level custom ops"),
                                               ("v0.4.0", "low-level custom ops")])
def test_doctor_says_which_path_the_ops_take(version, compiled, monkeypatch):
    from titan_primus.cli.doctor import diagnose, render

    install(monkeypatch, version)
    diagnosis = diagnose("gfx942")
    paths = diagnosis["primus_turbo_paths"]
    assert compiled in paths["compiled"] and "public ops" in paths["eager"]
    assert compiled in render(diagnosis)
    assert f"Primus-Turbo {version} API" in diagnosis["primus_turbo"]


# ---- the emulation's Primus-Turbo definitions: bit-identical payloads, scales, dequantization ----


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("axis", [None, -1, -2])
def test_emulated_quantization_is_the_kernels(arch, dtype, axis, monkeypatch):
    """Same FP8 payload, same scale_inv (fl(1/scale)), same dequantized values as the double's
    quantize kernel; only the GEMMs' accumulation order differs."""
    from titan_primus.scaling import dequantize, quantize

    release = install(monkeypatch, "v0.4.0", arch).release
    x = torch.randn(96, 160, dtype=dtype) * torch.logspace(-3, 3, 160)
    for fp8_dtype in (release.e4m3, release.e5m2):
        q, scale_inv = primus_turbo_double._quantize_kernel(x, fp8_dtype, axis)
        data, scale = quantize(x, fp8_dtype, None if axis is None else axis % 2, pow2=False)
        assert torch.equal(data.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(torch.reciprocal(scale), scale_inv)
        assert torch.equal(dequantize(data, scale, reciprocal=True), primus_turbo_double._dequantize_kernel(q, scale_inv, torch.float32))
