"""The Primus-Turbo backend for the block-scaled recipes ``blockwise`` (BLOCKWISE, block 128, every
tag, gfx942 and gfx950) and ``mxfp8`` (MX_BLOCKWISE, E8M0, block 32, v0.4.0 on gfx950), against
the TEST DOUBLE (tests/doubles/, each rule citing its upstream file): routing per tag and device,
the double's assertions, the adapter vs the emulation of the Primus-Turbo definition, refused
shapes, the compiled path. Not evidence about the real kernels."""

import importlib

import pytest
import torch
from doubles import primus_turbo_double
from helpers import make_offsets, reference_grouped, reference_linear, run_grouped, run_linear, sqnrs

import titan_primus as tp
from titan_primus.backends import EmulatedBackend
from titan_primus.backends.primus_turbo import OPS_MODULE

VERSIONS = primus_turbo_double.VERSIONS
ARCHS = ["gfx942", "gfx950"]


def install(monkeypatch, version, arch):
    api = primus_turbo_double.install(monkeypatch, version=version, arch=arch)
    tp.registry.refresh()
    return api


def low_precision():
    return importlib.import_module("primus_turbo.pytorch.core.low_precision")


# ---- routing per tag and device ----------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op", ["linear", "grouped_mm"])
def test_routing_per_tag_and_device(version, arch, op, monkeypatch):
    install(monkeypatch, version, arch)
    blockwise = tp.select_backend(op, "blockwise", arch, k=256, n=256)
    assert blockwise.backend_name == "primus_turbo"
    assert blockwise.recipe.definition == ("primus_turbo" if version >= "v0.3.1" else "primus_turbo_v0.2")
    assert blockwise.recipe.e4m3 == (torch.float8_e4m3fnuz if arch == "gfx942" else torch.float8_e4m3fn)
    if (version, arch) == ("v0.4.0", "gfx950"):
        mx = tp.select_backend(op, "mxfp8", arch, "primus_turbo", k=256, n=256)
        assert mx.backend_name == "primus_turbo" and mx.recipe.definition == "primus_turbo"
        assert mx.recipe.block_scale.rounding == "even"
        return
    with pytest.raises(tp.routing.BackendUnavailableError) as refused:
        tp.select_backend(op, "mxfp8", arch, "primus_turbo", k=256, n=256)
    expected = "upgrade Primus-Turbo to >= v0.4.0" if version != "v0.4.0" else "gfx950"
    assert expected in str(refused.value)


@pytest.mark.parametrize("version", VERSIONS)
def test_configs_per_tag(version, monkeypatch):
    """The Float8QuantConfig of each recipe, as docs/recipes-blocked.md's per-tag table says."""
    install(monkeypatch, version, "gfx950")
    lp, configs = low_precision(), tp.registry.get_backend("primus_turbo")._api.configs
    blockwise = configs["blockwise"]
    assert (blockwise.format, blockwise.granularity, blockwise.block_size) == (
        lp.Format.E4M3, lp.ScalingGranularity.BLOCKWISE, 128)
    if version != "v0.4.0":
        assert "mxfp8" not in configs
        return
    mx = configs["mxfp8"]
    assert (mx.format, mx.granularity, mx.scale_dtype, mx.block_size) == (
        lp.Format.E4M3, lp.ScalingGranularity.MX_BLOCKWISE, lp.ScaleDtype.E8M0, 32)


@pytest.mark.parametrize("recipe, arch, k, n, rule", [
    ("blockwise", "gfx942", 160, 256, "K=160"),
    ("blockwise", "gfx950", 256, 192, "N=192"),
    ("mxfp8", "gfx950", 160, 256, "K=160"),
    ("mxfp8", "gfx950", 256, 40, "N=40"),
])
@pytest.mark.parametrize("op", ["linear", "grouped_mm"])
def test_refused_shapes_route_elsewhere_with_the_reason(recipe, arch, k, n, rule, op, monkeypatch):
    """On an MI300-class GPU no other backend runs these recipes: auto routing refuses the layer
    with Primus-Turbo's reason (the converter keeps it in high precision and reports why)."""
    install(monkeypatch, "v0.4.0", arch)
    with pytest.raises(tp.routing.BackendUnavailableError) as refused:
        tp.select_backend(op, recipe, arch, k=k, n=n)
    reason = str(refused.value).split("primus_turbo: ")[1].split("; torchao:")[0]
    assert rule in reason and f"{recipe} GEMMs need" in reason
    # One block further is accepted: K 256 (MX: a multiple of 128), N 256 / 48.
    aligned = tp.select_backend(op, recipe, arch, "primus_turbo", k=256, n=256 if recipe == "blockwise" else 48)
    assert aligned.backend_name == "primus_turbo"


def test_mxfp8_on_gfx942_does_not_run_on_primus_turbo(monkeypatch):
    install(monkeypatch, "v0.4.0", "gfx942")
    backend = tp.registry.get_backend("primus_turbo")
    verdict = backend.supports("linear", "mxfp8", tp.device_profile("gfx942"), k=256, n=256)
    assert not verdict and "MX hardware" in verdict.reason and "gfx942" in verdict.reason


# ---- the double's assertions (each citing upstream in tests/doubles/) ---------------------------


def test_double_config_assertions(monkeypatch):
    install(monkeypatch, "v0.4.0", "gfx950")
    lp = low_precision()
    with pytest.raises(AssertionError, match="block_size must be set"):
        lp.Float8QuantConfig(format=lp.Format.E4M3, granularity=lp.ScalingGranularity.BLOCKWISE)
    with pytest.raises(AssertionError, match=r"block_size should be \[32\]"):
        lp.Float8QuantConfig(granularity=lp.ScalingGranularity.MX_BLOCKWISE, scale_dtype=lp.ScaleDtype.E8M0, block_size=64)
    with pytest.raises(AssertionError, match="scale_dtype should be"):
        lp.Float8QuantConfig(granularity=lp.ScalingGranularity.MX_BLOCKWISE, block_size=32)


def test_double_gemm_assertions(monkeypatch):
    install(monkeypatch, "v0.4.0", "gfx950")
    lp, turbo = low_precision(), importlib.import_module(OPS_MODULE)
    a, w = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(2, 128, 256, dtype=torch.bfloat16)
    lens = torch.tensor([40, 24])
    mx = lp.Float8QuantConfig(granularity=lp.ScalingGranularity.MX_BLOCKWISE, scale_dtype=lp.ScaleDtype.E8M0, block_size=32)
    with pytest.raises(AssertionError, match="trans_b=True"):
        turbo.ops.grouped_gemm_fp8(a, w.transpose(-2, -1).contiguous(), lens, trans_b=False,
                                   out_dtype=torch.bfloat16, config=mx)
    with pytest.raises(AssertionError, match="trans_b has to be True"):
        turbo.ops.gemm_fp8(a, w[0].t().contiguous(), trans_b=False, out_dtype=torch.bfloat16, config=mx)
    block64 = lp.Float8QuantConfig(format=lp.Format.E4M3, granularity=lp.ScalingGranularity.BLOCKWISE, block_size=64)
    with pytest.raises(AssertionError, match="Only block_size 128"):
        turbo.ops.grouped_gemm_fp8(a, w, lens, out_dtype=torch.bfloat16, config=block64)


def test_double_mx_needs_gfx950_and_v040(monkeypatch):
    lens = torch.tensor([40, 24])
    a, w = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(2, 128, 256, dtype=torch.bfloat16)
    install(monkeypatch, "v0.4.0", "gfx942")
    lp, turbo = low_precision(), importlib.import_module(OPS_MODULE)
    mx = lp.Float8QuantConfig(granularity=lp.ScalingGranularity.MX_BLOCKWISE, scale_dtype=lp.ScaleDtype.E8M0, block_size=32)
    with pytest.raises(AssertionError, match="gfx950 or higher"):
        turbo.ops.gemm_fp8(a, w[0], trans_b=True, out_dtype=torch.bfloat16, config=mx)
    with pytest.raises(AssertionError, match="gfx950 or higher"):
        turbo.ops.grouped_gemm_fp8(a, w, lens, out_dtype=torch.bfloat16, config=mx)
    install(monkeypatch, "v0.3.1", "gfx950")
    lp, turbo = low_precision(), importlib.import_module(OPS_MODULE)
    mx = lp.Float8QuantConfig(granularity=lp.ScalingGranularity.MX_BLOCKWISE, scale_dtype=lp.ScaleDtype.E8M0, block_size=32)
    with pytest.raises(ValueError, match="Unsupported FP8 ScalingGranularity"):
        turbo.ops.grouped_gemm_fp8(a, w, lens, out_dtype=torch.bfloat16, config=mx)


# ---- adapter vs the emulation of the Primus-Turbo definition --------------------------------------

CASES = [(v, "gfx942", "blockwise") for v in VERSIONS] + [("v0.4.0", "gfx950", "blockwise"), ("v0.4.0", "gfx950", "mxfp8")]


@pytest.mark.parametrize("version, arch, recipe", CASES)
def test_linear_matches_the_emulation(version, arch, recipe, monkeypatch):
    """>= 40 dB for out, grad_input, grad_weight against the emulation of the definition the
    installed release runs; M = 96 leaves a partial 128-row tile for the wgrad's token blocks."""
    install(monkeypatch, version, arch)
    decision = tp.select_backend("linear", recipe, arch, "primus_turbo", k=256, n=384)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 256, generator=g).bfloat16()
    w = (torch.randn(384, 256, generator=g) * 0.06).bfloat16()
    bias, grad = torch.randn(384, generator=g).bfloat16(), torch.randn(96, 384, generator=g)
    turbo = run_linear(lambda x, w, b: decision.backend.linear(x, w, b, decision.recipe), x, w, bias, grad)
    emulated = run_linear(lambda x, w, b: EmulatedBackend().linear(x, w, b, decision.recipe), x, w, bias, grad)
    assert all(db >= 40 for db in sqnrs(emulated, turbo)), sqnrs(emulated, turbo)
    vs_fp32 = sqnrs(reference_linear(x, w, bias, grad)[:3], turbo[:3])
    assert all(20 < db < 45 for db in vs_fp32), vs_fp32  # FP8 accuracy: the casts happened
    kind = "mx" if recipe == "mxfp8" else "blockwise"
    assert primus_turbo_double.KERNEL_CALLS[f"gemm_fp8_{kind}"] == 3


@pytest.mark.parametrize("version, arch, recipe", CASES)
@pytest.mark.parametrize("layout", ["transposed_view", "contiguous"])
def test_grouped_matches_the_emulation(version, arch, recipe, layout, monkeypatch):
    """Unbalanced groups with an empty one and rows past the last group (zero output and
    gradient through the adapter at every tag); token blocks restart at every group."""
    install(monkeypatch, version, arch)
    decision = tp.select_backend("grouped_mm", recipe, arch, "primus_turbo", k=256, n=256)
    g = torch.Generator().manual_seed(2)
    counts, trailing = [70, 0, 33, 150], 9
    offs = make_offsets(counts)
    A = torch.randn(sum(counts) + trailing, 256, generator=g).bfloat16()
    weights = (torch.randn(len(counts), 256, 256, generator=g) * 0.06).bfloat16()  # [E, N, K]
    B_t = weights.transpose(-2, -1)
    B_t = B_t if layout == "transposed_view" else B_t.contiguous()
    grad = torch.randn(A.shape[0], 256, generator=g)
    turbo = run_grouped(lambda *args: decision.backend.grouped_mm(*args, decision.recipe), A, B_t, offs, grad)
    emulated = run_grouped(lambda *args: EmulatedBackend().grouped_mm(*args, decision.recipe), A, B_t, offs, grad)
    assert all(db >= 40 for db in sqnrs(emulated, turbo)), sqnrs(emulated, turbo)
    vs_fp32 = sqnrs(reference_grouped(A, weights.transpose(-2, -1), offs, grad), turbo)
    assert all(20 < db < 45 for db in vs_fp32), vs_fp32
    out, grad_A, grad_B = turbo
    assert all(torch.isfinite(t).all() for t in turbo)
    assert torch.count_nonzero(out[-trailing:]) == 0 and torch.count_nonzero(grad_A[-trailing:]) == 0
    kind = "mx" if recipe == "mxfp8" else "blockwise"
    assert primus_turbo_double.KERNEL_CALLS[f"grouped_gemm_fp8_{kind}"] == 3


# ---- compile -------------------------------------------------------------------------------------


@pytest.mark.parametrize("version, arch, recipe", [("v0.4.0", "gfx950", "mxfp8"), ("v0.4.0", "gfx942", "blockwise"),
                                                   ("v0.2.0", "gfx942", "blockwise")])
def test_compiled_path_equals_eager(version, arch, recipe, monkeypatch):
    """fullgraph torch.compile: the public block ops inside titan-primus's custom ops (the path
    execution_paths names), equal to eager."""
    install(monkeypatch, version, arch)
    linear = tp.select_backend("linear", recipe, arch, "primus_turbo", k=256, n=128)
    grouped = tp.select_backend("grouped_mm", recipe, arch, "primus_turbo", k=256, n=256)
    offs = make_offsets([20, 0, 45])

    def step(x, w, A, W):
        out = linear.backend.linear(x, w, None, linear.recipe).float().sum()
        return out + grouped.backend.grouped_mm(A, W.transpose(-2, -1), offs, grouped.recipe).float().sum()

    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(64, 256, generator=g).bfloat16(), torch.randn(128, 256, generator=g).bfloat16(),
              torch.randn(70, 256, generator=g).bfloat16(), torch.randn(3, 256, 256, generator=g).bfloat16()]

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in inputs]
        fn(*leaves).backward()
        return [t.grad for t in leaves]

    torch._dynamo.reset()
    eager = grads(step)
    compiled = grads(torch.compile(step, fullgraph=True))
    assert all(db >= 40 for db in sqnrs(eager, compiled)), sqnrs(eager, compiled)
    paths = tp.registry.get_backend("primus_turbo").execution_paths()
    assert "custom op" in paths["compiled, mxfp8 / blockwise"]


@pytest.mark.parametrize("version", VERSIONS)
def test_blockwise_grouped_small_contraction(version, monkeypatch):
    """The blockwise Triton grouped kernel (v0.3.1+) states tl.assume(loop_k > 1) like the
    rowwise one: K = 128 is refused there (the double raises); v0.4.0's MX grouped kernel does not."""
    install(monkeypatch, version, "gfx950")
    turbo = importlib.import_module(OPS_MODULE)
    config = tp.registry.get_backend("primus_turbo")._api.configs["blockwise"]
    A, W = torch.randn(40, 128, dtype=torch.bfloat16), torch.randn(2, 256, 128, dtype=torch.bfloat16)
    lens = torch.tensor([30, 10])
    extra = {"out_dtype": torch.bfloat16} if version >= "v0.3.1" else {}
    if version < "v0.3.1":
        assert torch.isfinite(turbo.ops.grouped_gemm_fp8(A, W, lens, config=config, **extra)[:40]).all()
        assert tp.select_backend("grouped_mm", "blockwise", "gfx950", "primus_turbo", k=128, n=256)
        return
    with pytest.raises(RuntimeError, match="loop_k > 1"):
        turbo.ops.grouped_gemm_fp8(A, W, lens, config=config, **extra)
    with pytest.raises(tp.routing.BackendUnavailableError, match="loop_k > 1"):
        tp.select_backend("grouped_mm", "blockwise", "gfx950", "primus_turbo", k=128, n=256)
    if version == "v0.4.0":
        assert tp.select_backend("grouped_mm", "mxfp8", "gfx950", "primus_turbo", k=128, n=256).backend_name == "primus_turbo"
