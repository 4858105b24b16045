"""Every Primus-Turbo shape rule at its edge, against Primus-Turbo's own kernels: just inside,
titan-primus routes the op there and it runs (no ``tl.assume`` fails, nothing non-finite comes
back); just outside, titan-primus routes it elsewhere with the reason, and Primus-Turbo's own op
fails there (the interpreter checks ``tl.assume``; on a GPU it is undefined behaviour)."""

import importlib

import pytest
import torch
from triton.runtime import errors as triton_errors

import titan_primus as tp
from real_turbo.conftest import ARCH, BUILD, RECIPES, TURBO
from real_turbo.calls import CudaLooking, grads, turbo_config
from titan_primus.backends.primus_turbo import load_api
from titan_primus.backends.primus_turbo.autograd import group_offsets
from titan_primus.grouping import group_lens

TRITON_DENSE = BUILD != "v0.3.1"  # rowwise dense GEMMs run on Triton from v0.3.2.dev48


ASSUME_FAILED = (AssertionError, triton_errors.InterpreterError)


def _route(op, recipe, k, n):
    return tp.select_backend(op, recipe, ARCH, k=k, n=n)


def _refusal(op, recipe, k, n) -> str:
    """Why routing passes over Primus-Turbo for these dims ("" where it takes it)."""
    verdict = tp.registry.get_backend("primus_turbo").supports(op, recipe, tp.device_profile(ARCH), k=k, n=n)
    return "" if verdict else verdict.reason


def _turbo_linear(recipe, x, w):
    out_dtype = x.dtype if x.dtype != torch.float32 else torch.bfloat16
    return grads(
        lambda a, b: TURBO.ops.gemm_fp8(a, b, trans_b=True, out_dtype=out_dtype, config=turbo_config(recipe)), x, w
    )


def _ours_linear(recipe, x, w):
    decision = tp.select_backend("linear", recipe, ARCH, "primus_turbo", k=x.shape[1], n=w.shape[0])
    return grads(lambda a, b: decision.backend.linear(a, b, None, decision.recipe), x, w)


def _finite(*tensors):
    return all(torch.isfinite(t).all() for t in tensors)


def test_release_is_detected_from_signatures():
    api = load_api()
    expected = {
        "v0.3.1": "v0.3.1",
        "v0.3.2.dev48": "v0.3.2.dev48",
        "v0.4.0": "v0.3.2.dev48",
        "v0.4.1.dev26": "v0.3.2.dev48",
    }
    assert api.surface == expected[BUILD]
    assert api.version == BUILD.removeprefix("v")
    assert api.float8_e4m3 == (torch.float8_e4m3fnuz if ARCH == "gfx942" else torch.float8_e4m3fn)


def test_doctor_names_the_build():
    names = {
        "v0.3.1": "0.3.1",
        "v0.3.2.dev48": "0.3.2.dev48 (v0.3.1 + 48 commits, AMD rocm/primus v26.5)",
        "v0.4.0": "0.4.0",
        "v0.4.1.dev26": "0.4.1.dev26 (v0.4.0 + 26 commits, AMD rocm/primus v26.6)",
    }
    assert load_api().build == names[BUILD]
    from titan_primus.diagnostics.environment import diagnose
    from titan_primus.cli.doctor import render

    assert f"Primus-Turbo {names[BUILD]} on {ARCH}" in render(diagnose(device=ARCH))


# ---- dense Triton GEMMs: tl.assume(loop_k > 1) over K, N and the token count ------------------------


@pytest.mark.skipif(not TRITON_DENSE, reason="v0.3.1 runs rowwise dense GEMMs on CK")
def test_dense_contraction_k_at_the_edge():
    w = torch.randn(256, 256, dtype=torch.bfloat16)
    assert _route("linear", "rowwise", 256, 256).backend_name == "primus_turbo"
    assert _finite(*_ours_linear("rowwise", torch.randn(256, 256, dtype=torch.bfloat16), w))
    assert "loop_k > 1" in _refusal("linear", "rowwise", 240, 256)
    with pytest.raises(ASSUME_FAILED, match="Assume failed"):
        _turbo_linear(
            "rowwise", torch.randn(256, 240, dtype=torch.bfloat16), torch.randn(256, 240, dtype=torch.bfloat16)
        )


@pytest.mark.skipif(not TRITON_DENSE, reason="v0.3.1 runs rowwise dense GEMMs on CK")
def test_dense_contraction_n_is_refused_under_256():
    """The dgrad contracts over N: BLOCK_K 64 there on gfx942, 128 on gfx950."""
    assert "N=240" in _refusal("linear", "rowwise", 256, 240)
    x, w = torch.randn(256, 256, dtype=torch.bfloat16), torch.randn(240, 256, dtype=torch.bfloat16)
    if ARCH == "gfx950":
        with pytest.raises(ASSUME_FAILED, match="Assume failed"):
            _turbo_linear("rowwise", x, w)
    x, w = torch.randn(256, 256, dtype=torch.bfloat16), torch.randn(112, 256, dtype=torch.bfloat16)
    with pytest.raises(ASSUME_FAILED, match="Assume failed"):  # under 2 x 64 on either
        _turbo_linear("rowwise", x, w)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("tokens", [1, 7, 64, 255, 256, 300])
def test_any_number_of_tokens(recipe, tokens):
    """The wgrad contracts over tokens: rows are zero-padded to the kernels' minimum, which is
    exact (the result equals Primus-Turbo's own op on the padded input, sliced)."""
    x, w = torch.randn(tokens, 256, dtype=torch.bfloat16), torch.randn(256, 256, dtype=torch.bfloat16)
    ours = _ours_linear(recipe, x, w)
    assert _finite(*ours) and ours[0].shape == (tokens, 256)
    rows = max(tokens, 256) if recipe != "blockwise" and (TRITON_DENSE or recipe == "tensorwise") else tokens
    padded = torch.cat([x, x.new_zeros(rows - tokens, 256)])
    leaves = [padded.clone().requires_grad_(), w.clone().requires_grad_()]
    out_dtype = torch.bfloat16
    theirs = TURBO.ops.gemm_fp8(*leaves, trans_b=True, out_dtype=out_dtype, config=turbo_config(recipe))
    grad = torch.randn(ours[0].shape, generator=torch.Generator().manual_seed(7)).to(out_dtype)
    theirs.backward(torch.cat([grad, grad.new_zeros(rows - tokens, 256)]))
    assert torch.equal(ours[0], theirs[:tokens].detach())
    assert torch.equal(ours[1], leaves[0].grad[:tokens]) and torch.equal(ours[2], leaves[1].grad)


@pytest.mark.skipif(not TRITON_DENSE, reason="v0.3.1 runs rowwise dense GEMMs on CK")
def test_primus_turbos_own_op_fails_on_few_tokens():
    """What the padding avoids: 64 tokens under the wgrad's two BLOCK_K steps."""
    x, w = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(256, 256, dtype=torch.bfloat16)
    with pytest.raises(ASSUME_FAILED, match="Assume failed"):
        _turbo_linear("rowwise", x, w)


# ---- CK (v0.3.1's rowwise dense GEMMs): contraction dims % 32 ------------------------------------------


@pytest.mark.skipif(TRITON_DENSE, reason="CK runs rowwise dense GEMMs at v0.3.1 only")
def test_ck_alignment_at_the_edge():
    assert _route("linear", "rowwise", 288, 256).backend_name == "primus_turbo"
    assert _finite(
        *_ours_linear(
            "rowwise", torch.randn(64, 288, dtype=torch.bfloat16), torch.randn(256, 288, dtype=torch.bfloat16)
        )
    )
    assert "divisible by 32" in _refusal("linear", "rowwise", 272, 256)
    with pytest.raises(Exception, match="multiple of 32"):
        _turbo_linear(
            "rowwise", torch.randn(64, 272, dtype=torch.bfloat16), torch.randn(256, 272, dtype=torch.bfloat16)
        )


# ---- grouped Triton GEMMs: tl.assume(loop_k > 1) over K and N ------------------------------------------


def _turbo_grouped(recipe, A, W, counts):
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    lens = group_lens(offs).as_subclass(CudaLooking)
    return grads(
        lambda a, w: TURBO.ops.grouped_gemm_fp8(
            a,
            w,
            lens,
            group_offs=group_offsets(offs),
            trans_b=True,
            out_dtype=torch.bfloat16,
            config=turbo_config(recipe),
        ),
        A,
        W,
    )


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_grouped_contraction_at_the_edge(recipe):
    inside = _route("grouped_mm", recipe, 256, 256)
    assert inside.backend_name == "primus_turbo"
    counts, A = [24, 0, 40], torch.randn(64, 256, dtype=torch.bfloat16)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    W = torch.randn(3, 256, 256, dtype=torch.bfloat16)
    got = grads(lambda a, w: inside.backend.grouped_mm(a, w.transpose(-2, -1), offs, inside.recipe), A, W)
    assert _finite(*got)
    small = 128 if recipe == "blockwise" else 240  # blockwise needs K % 128
    for k, n in ((small, 256), (256, small)):
        assert "loop_k > 1" in _refusal("grouped_mm", recipe, k, n)
    with pytest.raises(ASSUME_FAILED, match="Assume failed"):  # K (forward)
        _turbo_grouped(
            recipe,
            torch.randn(64, small, dtype=torch.bfloat16),
            torch.randn(3, 256, small, dtype=torch.bfloat16),
            counts,
        )


# ---- 16-bit output, fp32 activations, rows past the groups -----------------------------------------------


def test_the_kernels_write_16_bit_output_only():
    x, w = torch.randn(256, 256), torch.randn(256, 256)
    with pytest.raises(ValueError, match="No compatible backend"):
        TURBO.ops.gemm_fp8(x, w, trans_b=True, out_dtype=torch.float32, config=turbo_config("rowwise"))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp32_activations_keep_their_dtype(recipe):
    x, w = torch.randn(64, 256), torch.randn(256, 256) * 0.05
    out, grad_x, grad_w = _ours_linear(recipe, x, w)
    assert (out.dtype, grad_x.dtype, grad_w.dtype) == (torch.float32,) * 3
    assert torch.equal(out, out.bfloat16().float())  # a bf16 result, upcast
    assert _finite(out, grad_x, grad_w)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_rows_past_the_groups(recipe):
    """Primus-Turbo leaves output rows past the last group unwritten before v0.4.0 (torch.empty;
    v0.4.0 zeroes them, grouped_gemm_output_tail_kernel); through titan-primus they are zero, as
    are their gradients, at every build."""
    decision = _route("grouped_mm", recipe, 256, 256)
    offs = torch.tensor([30, 40], dtype=torch.int32)
    A, W = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(2, 256, 256, dtype=torch.bfloat16)
    out, grad_A, grad_W = grads(
        lambda a, w: decision.backend.grouped_mm(a, w.transpose(-2, -1), offs, decision.recipe), A, W
    )
    assert _finite(out, grad_A, grad_W)
    assert (out[40:] == 0).all() and (grad_A[40:] == 0).all()


def test_a_build_that_renamed_an_argument_titan_primus_passes_is_refused_at_load(monkeypatch):
    """Issue 42: titan-primus calls Primus-Turbo's GEMMs and quantizers by argument name, each name
    checked when Primus-Turbo is loaded (release.CALLED_BY_NAME). A quantizer without ``axis`` (the
    issue's simulated upgrade) is refused there, named; one with a new optional argument passes."""
    import importlib

    from titan_primus.backends.primus_turbo import release

    quant = importlib.import_module(release.QUANT_MODULE)
    real = quant.dequantize_fp8_rowwise_impl

    def with_new_option(x, out_dtype, axis, scale_inv, round_mode="rne"):
        return real(x, out_dtype, axis, scale_inv)

    monkeypatch.setattr(quant, "dequantize_fp8_rowwise_impl", with_new_option)
    assert release._load().build == load_api().build

    def without_axis(x, out_dtype, scale_inv):
        return real(x, out_dtype, -1, scale_inv)

    monkeypatch.setattr(quant, "dequantize_fp8_rowwise_impl", without_axis)
    with pytest.raises(release.UnsupportedRelease, match=r"dequantize_fp8_rowwise_impl takes no argument axis"):
        release._load()


def test_a_build_that_renamed_a_function_or_added_a_required_argument_is_refused_at_load(monkeypatch):
    """Issue 42's other simulated upgrades of a called function, on the real build: renamed (the
    old name gone), or given a new argument without a default (the first call would raise inside a
    training step). Each is refused when Primus-Turbo is loaded, naming the function, what changed,
    titan-primus's file and the verified builds."""
    import importlib

    from titan_primus.backends.primus_turbo import release

    quant = importlib.import_module(release.QUANT_MODULE)
    real = quant.dequantize_fp8_rowwise_impl

    def with_new_requirement(x, out_dtype, axis, scale_inv, round_mode):
        return real(x, out_dtype, axis, scale_inv)

    monkeypatch.setattr(quant, "dequantize_fp8_rowwise_impl", with_new_requirement)
    with pytest.raises(
        release.UnsupportedRelease,
        match=r"dequantize_fp8_rowwise_impl requires round_mode, which titan-primus does not pass "
        r"\(titan_primus/backends/primus_turbo/autograd\.py; verified at v0\.3\.1",
    ):
        release._load()
    monkeypatch.setattr(quant, "dequantize_fp8_rowwise_impl", real)
    monkeypatch.delattr(quant, "dequantize_fp8_rowwise_impl")
    monkeypatch.setattr(quant, "dequantize_fp8_rowwise", real, raising=False)
    with pytest.raises(
        release.UnsupportedRelease, match=r"dequantize_fp8_rowwise_impl is not there \(titan-primus calls it\)"
    ):
        release._load()


def test_doctor_finds_every_primus_turbo_contract_of_this_build_and_names_one_that_differs(monkeypatch):
    """``titan-primus doctor``'s contract rows on the real build: every function and op titan-primus
    calls by name is there with its arguments; one whose argument was renamed differs, named."""
    from titan_primus.backends.primus_turbo import release
    from titan_primus.diagnostics.contracts import contract_states

    def turbo_rows():
        return {s["symbol"]: s for s in contract_states() if s["upstream"] == "Primus-Turbo"}

    rows = turbo_rows()
    assert set(rows) == set(release.CALLED_BY_NAME) and {r["state"] for r in rows.values()} == {"ok"}, rows
    quant = importlib.import_module(release.QUANT_MODULE)
    real = quant.dequantize_fp8_rowwise_impl

    def without_axis(x, out_dtype, scale_inv):
        return real(x, out_dtype, -1, scale_inv)

    monkeypatch.setattr(quant, "dequantize_fp8_rowwise_impl", without_axis)
    row = turbo_rows()["dequantize_fp8_rowwise_impl"]
    assert row["state"] == "differs" and "takes no argument axis" in row["found"], row


def test_a_build_newer_than_every_verified_one_is_named_so_and_runs_where_its_checks_pass(monkeypatch, caplog):
    """Issue 42: this build's own code reported as a newer release (0.9.0): loading it warns in
    the log of the conversion that loads it, and doctor names it, as newer than the newest
    verified build; it loads (every call it takes matches) and converts (its kernels pass the
    numeric self-check)."""
    import primus_turbo

    from titan_primus.backends.primus_turbo import release
    from titan_primus.conversion import ConversionOptions, LayerRouter
    from titan_primus.diagnostics.environment import diagnose
    from titan_primus.self_check import _PASSED

    named = "0.9.0 (newer than the newest verified build v0.4.1.dev26: used only where its calls match"
    monkeypatch.setattr(primus_turbo, "__version__", "0.9.0")
    tp.registry.refresh()
    release.forget_api()
    _PASSED.clear()
    try:
        with caplog.at_level("WARNING", logger="titan_primus"):
            router = LayerRouter(ConversionOptions(backend="primus_turbo", recipe="rowwise", device=ARCH))
            assert router.decision("linear").backend_name == "primus_turbo"
        assert f"titan-primus: Primus-Turbo {named}" in caplog.text
        (row,) = [b for b in diagnose(device=ARCH)["backends"] if b["name"] == "primus_turbo"]
        assert f"Primus-Turbo {named}" in row["reason"], row
    finally:
        monkeypatch.undo()
        release.forget_api()
        tp.registry.refresh()
        _PASSED.clear()


def test_a_quantizer_that_returns_another_number_of_values_stops_conversion(monkeypatch):
    """Issue 42's return-arity change: a rowwise quantizer that returns a third value passes
    every signature check; the numeric self-check calls it at conversion on the device it runs on
    (here the profile an MI300's detection gives), which stops there, naming the op and the
    error, before any training step."""
    import functools
    import importlib
    from dataclasses import replace

    import titan_primus.device
    from titan_primus.backends.primus_turbo.release import QUANT_MODULE
    from titan_primus.conversion import ConversionOptions, LayerRouter
    from titan_primus.self_check import _PASSED, Fp8SelfCheckError

    quant = importlib.import_module(QUANT_MODULE)
    real = quant.quantize_fp8_rowwise_impl

    @functools.wraps(real)  # the same signature: only what it returns changed
    def three_values(**kwargs):
        return (*real(**kwargs), None)

    monkeypatch.setattr(quant, "quantize_fp8_rowwise_impl", three_values)
    detected = replace(tp.device_profile(ARCH), detected=True)
    monkeypatch.setattr(titan_primus.device, "detect_device", lambda index=None: detected)
    _PASSED.clear()
    router = LayerRouter(ConversionOptions(backend="primus_turbo", recipe="rowwise"))
    with pytest.raises(
        Fp8SelfCheckError, match=r"linear with rowwise .*raised on a tiny input at conversion: ValueError"
    ):
        router.decision("linear")
    _PASSED.clear()


def test_an_attention_op_that_renamed_an_argument_refuses_that_attention_only(monkeypatch):
    """The attention ops are called by argument name too (attention_fp8.py, attention_bf16.py),
    their names checked at load with the GEMMs'. A change in an op that is not routed changes
    nothing: an FP8 attention forward whose ``use_fp8`` was renamed leaves the build loaded, the
    GEMMs and bf16 attention routed; FP8 attention is refused at routing, naming the op, the
    argument and the titan-primus file, and doctor's contract row for it differs."""
    import inspect

    from titan_primus.attention import AttentionSite
    from titan_primus.backends.primus_turbo import release
    from titan_primus.conversion import ConversionOptions, LayerRouter
    from titan_primus.diagnostics.contracts import contract_states

    triton_impl = importlib.import_module(release.ATTENTION_IMPL_MODULES[0])
    real = triton_impl.attention_triton_forward_impl
    names = [a.name for a in real._opoverload._schema.arguments]
    assert "use_fp8" in names

    def renamed(**kwargs):
        return real(**kwargs)

    renamed.__signature__ = inspect.Signature(
        [inspect.Parameter("fp8" if n == "use_fp8" else n, inspect.Parameter.KEYWORD_ONLY) for n in names]
    )
    monkeypatch.setattr(triton_impl, "attention_triton_forward_impl", renamed)
    release.forget_api()
    try:
        router = LayerRouter(
            ConversionOptions(backend="primus_turbo", recipe="rowwise", device=ARCH, attention=True, fp8_attention=True)
        )
        assert router.decision("linear").backend_name == "primus_turbo"
        route = router.attention("layers.0.attention.inner_attention", AttentionSite(causal=True, head_dims=(64, 64)))
        assert (route.backend, route.fp8) == ("primus_turbo", False), route
        assert "FP8 attention refused" in route.reason and "attention_fp8.py" in route.reason, route.reason
        assert "attention_triton_forward_impl takes no argument use_fp8" in route.reason, route.reason
        (row,) = [c for c in contract_states() if c["symbol"] == "attention_triton_forward_impl"]
        assert row["state"] == "differs" and "use_fp8" in row["found"], row
    finally:
        monkeypatch.undo()
        release.forget_api()


def test_a_public_op_mxfp8_calls_that_renamed_an_argument_refuses_mxfp8_only(monkeypatch):
    """mxfp8 runs Primus-Turbo's public ``gemm_fp8`` (mx.py), checked at load with the rest: one
    whose ``config`` was renamed refuses mxfp8, naming the op, the argument and mx.py; the other
    recipes, which never call it, route as before."""
    import inspect

    from titan_primus.backends.primus_turbo import release

    ops = importlib.import_module(release.PUBLIC_OPS_MODULE)
    real = ops.gemm_fp8

    def renamed(a, b, trans_a=False, trans_b=False, out_dtype=None, quant_config=None):
        return real(a=a, b=b, trans_a=trans_a, trans_b=trans_b, out_dtype=out_dtype, config=quant_config)

    assert "config" in inspect.signature(real).parameters
    monkeypatch.setattr(ops, "gemm_fp8", renamed)
    release.forget_api()
    try:
        backend, profile = tp.registry.get_backend("primus_turbo"), tp.device_profile(ARCH)
        refused = backend.supports("linear", "mxfp8", profile, k=256, n=256)
        assert not refused and "gemm_fp8 takes no argument config" in refused.reason, refused.reason
        assert "mx.py" in refused.reason, refused.reason
        assert backend.supports("linear", "rowwise", profile, k=256, n=256)
    finally:
        monkeypatch.undo()
        release.forget_api()


@pytest.mark.parametrize("op", ["linear", "grouped_mm"])
def test_the_conversion_self_check_passes_the_real_kernels_and_refuses_a_transposed_weight_scale(op, monkeypatch):
    """Issue 42's silent change: Primus-Turbo's blockwise weight quantizer returning its
    ``scale_inv`` transposed passes every signature check and computed 21-24 dB against the
    emulation where the real kernels give 90 dB. The numeric self-check at conversion runs every
    recipe's kernels here (forward and backward, on inputs of two scaling blocks per dimension),
    passes them, and stops conversion on the transposed scale with the figures."""
    import time

    from titan_primus.backends.primus_turbo.release import QUANT_MODULE
    from titan_primus.conversion import ConversionOptions, LayerRouter
    from titan_primus.self_check import _PASSED, Fp8SelfCheckError

    def route(recipe):
        return LayerRouter(ConversionOptions(backend="primus_turbo", recipe=recipe, device=ARCH)).decision(op)

    for recipe in RECIPES:
        _PASSED.clear()
        started = time.perf_counter()
        assert route(recipe).backend_name == "primus_turbo"
        (figures,) = _PASSED.values()
        print(f"self-check {BUILD} {ARCH} {op} {recipe}: {time.perf_counter() - started:.2f} s, {figures}")
        assert "floor 40 dB" in figures
    quant = importlib.import_module(QUANT_MODULE)
    real = quant.quant_fp8_blockwise_for_weight_impl

    def transposed_scales(**kwargs):
        q, scale_inv = real(**kwargs)
        return q, scale_inv.transpose(-2, -1).contiguous()

    monkeypatch.setattr(quant, "quant_fp8_blockwise_for_weight_impl", transposed_scales)
    _PASSED.clear()
    with pytest.raises(
        Fp8SelfCheckError, match=rf"primus_turbo backend's {op} with blockwise .* SQNR [0-9.]+ dB < 40 dB"
    ):
        route("blockwise")
    _PASSED.clear()


_OTHER_FP8 = {torch.float8_e4m3fnuz: torch.float8_e4m3fn, torch.float8_e4m3fn: torch.float8_e4m3fnuz}


@pytest.mark.parametrize("change", ["fp32 GEMM output", "other FP8 format"])
def test_an_output_dtype_change(change, monkeypatch):
    """Issue 42's output dtype change, two ways, each passing every signature check. Primus-Turbo's
    dense FP8 GEMM returning fp32 where bf16 was asked for is harmless: titan-primus casts a
    linear's output to the input's dtype, so conversion passes and the numbers are the same. Its
    rowwise quantizer writing the other e4m3 format (FNUZ codes read as OCP, or back: every value
    2x off) is refused by the GEMMs it feeds, which the numeric self-check calls at conversion on
    the device it runs on (here the profile an MI300's detection gives): conversion stops there."""
    import functools
    from dataclasses import replace

    import titan_primus.device
    from titan_primus.backends.primus_turbo import release
    from titan_primus.conversion import ConversionOptions, LayerRouter
    from titan_primus.self_check import _PASSED, Fp8SelfCheckError

    if change == "fp32 GEMM output":
        module, name = importlib.import_module(release.GEMM_IMPL_MODULE), "gemm_fp8_impl"
        real = module.gemm_fp8_impl

        def changed(**kwargs):
            return real(**kwargs).float()

    else:
        module, name = importlib.import_module(release.QUANT_MODULE), "quantize_fp8_rowwise_impl"
        real = module.quantize_fp8_rowwise_impl

        def changed(**kwargs):
            codes, scale_inv = real(**kwargs)
            return codes.view(_OTHER_FP8[codes.dtype]), scale_inv

    monkeypatch.setattr(module, name, functools.wraps(real)(changed))  # the same signature
    detected = replace(tp.device_profile(ARCH), detected=True)
    monkeypatch.setattr(titan_primus.device, "detect_device", lambda index=None: detected)
    release.forget_api()
    _PASSED.clear()
    router = LayerRouter(ConversionOptions(backend="primus_turbo", recipe="rowwise"))
    try:
        if change == "fp32 GEMM output":
            assert router.decision("linear").backend_name == "primus_turbo"
            (figures,) = _PASSED.values()
            assert "floor 40 dB" in figures, figures
        else:
            with pytest.raises(
                Fp8SelfCheckError,
                match=r"(?s)primus_turbo's linear with rowwise .* raised on a tiny input.*Installed: Primus-Turbo .*Fix: install",
            ):
                router.decision("linear")
    finally:
        monkeypatch.undo()
        release.forget_api()
        _PASSED.clear()
