"""Routing and conversion with Primus-Turbo's own package installed: what runs there on each
build and architecture, what falls back and why, and that every shape the router accepts runs,
for any number of tokens."""

import pytest
import torch
import torch.nn.functional as F
from support.titan_helpers import model_config

import titan_primus as tp
from real_turbo.conftest import ARCH, BUILD, one_arch
from real_turbo.calls import grads
from titan_primus.backends.primus_turbo import MX_ON_REQUEST
from titan_primus.torchtitan import Float8Converter

MX_BUILDS = ("v0.3.2.dev48", "v0.4.0", "v0.4.1.dev26")  # their MX Python code is the same


def test_converter_routes_linears_and_experts_to_primus_turbo():
    converter = Float8Converter.Config(device=ARCH).build()
    config = converter.convert(model_config("deepseek_v3"))
    assert {op: d.backend_name for op, d in converter.report.decisions.items()} == {
        "linear": "primus_turbo",
        "grouped_mm": "primus_turbo",
    }
    assert converter.report.decisions["linear"].recipe.definition == "primus_turbo"
    assert "-> primus_turbo" in converter.report.summary()
    # rowwise_with_gw_hp has no Primus-Turbo equivalent: it falls back, saying why.
    converter = Float8Converter.Config(device=ARCH, recipe="rowwise_with_gw_hp").build()
    converter.convert(model_config("deepseek_v3"))
    assert converter.report.decisions["linear"].backend_name == "torchao"
    assert "no 'rowwise_with_gw_hp' recipe" in dict(converter.report.decisions["linear"].passed_over)["primus_turbo"]

    def signature(config):
        with torch.device("meta"):
            module = config.build()
        return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}

    assert signature(config) == signature(model_config("deepseek_v3"))


@pytest.mark.parametrize("op", ["linear", "grouped_mm"])
def test_block_recipes_per_build_and_architecture(op):
    blockwise = tp.select_backend(op, "blockwise", ARCH, k=256, n=256)
    assert blockwise.backend_name == "primus_turbo" and blockwise.recipe.definition == "primus_turbo"
    verdict = tp.registry.get_backend("primus_turbo").supports(op, "mxfp8", tp.device_profile(ARCH), k=256, n=256)
    if ARCH == "gfx950" and BUILD in MX_BUILDS:
        assert verdict
        # Runs only when asked for by name (its FlyDSL / HIP kernels have not run on an MI355X):
        # auto passes it over with the reason; nothing else here runs mxfp8 on gfx950.
        with pytest.raises(tp.BackendUnavailableError) as refused:
            tp.select_backend(op, "mxfp8", ARCH, k=256, n=256)
        assert f"primus_turbo: {MX_ON_REQUEST}" in str(refused.value)
        named = tp.select_backend(op, "mxfp8", ARCH, "primus_turbo", k=256, n=256)
        assert named.backend_name == "primus_turbo" and named.reason == "requested by name"
    else:
        assert not verdict
        assert ("upgrade Primus-Turbo" if BUILD not in MX_BUILDS else "MX hardware") in verdict.reason


@pytest.mark.parametrize("op", ["linear", "grouped_mm"])
@pytest.mark.parametrize("recipe, k, n, rule", [("blockwise", 384, 320, "N=320"), ("blockwise", 160, 256, "K=160")])
def test_block_shapes_are_refused_with_the_reason(op, recipe, k, n, rule):
    verdict = tp.registry.get_backend("primus_turbo").supports(op, recipe, tp.device_profile(ARCH), k=k, n=n)
    assert not verdict and rule in verdict.reason and "divisible by its 128 block" in verdict.reason


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_linear_dtypes_follow_nn_linear(recipe):
    """The dtype contract (docs/recipes.md, "The dtype contract"): the autocast dtype under autocast, x's dtype otherwise;
    gradients in the inputs' dtypes."""
    for x_dtype in (torch.float32, torch.float16, torch.bfloat16):
        for autocast_dtype in (None, torch.bfloat16, torch.float16):
            x, w, b = (
                t.clone().requires_grad_()
                for t in (torch.randn(32, 256, dtype=x_dtype), torch.randn(256, 256) * 0.1, torch.randn(256))
            )
            context = (
                torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else torch.autocast("cpu", enabled=False)
            )
            with context:
                expected = F.linear(x.detach(), w.detach().to(x_dtype), b.detach().to(x_dtype)).dtype
                out = tp.fp8_linear(x, w, b, recipe=recipe, backend="primus_turbo", device=ARCH)
            assert out.dtype == (expected if autocast_dtype else x_dtype), (x_dtype, autocast_dtype)
            out.backward(torch.randn_like(out))
            assert (x.grad.dtype, w.grad.dtype, b.grad.dtype) == (x_dtype, torch.float32, torch.float32)


# K and N around every rule: the 16 alignment, CK's 32 (v0.3.1), Triton's 256, blockwise's 128.
DIMS = (240, 256, 272, 288, 384)


@one_arch
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_every_linear_shape_the_router_accepts_runs_for_any_token_count(recipe):
    """No tl.assume fails (the interpreter raises on one) and nothing non-finite comes back for
    any (K, N) Primus-Turbo accepts, with 1, 17 or 300 tokens."""
    backend, device = tp.registry.get_backend("primus_turbo"), tp.device_profile(ARCH)
    made = backend.recipe_for(recipe, device)
    accepted = [(k, n) for k in DIMS for n in DIMS if backend.supports("linear", recipe, device, k=k, n=n)]
    assert accepted
    for k, n in accepted:
        for tokens in (1, 17, 300):
            x, w = torch.randn(tokens, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
            got = grads(lambda a, b: backend.linear(a, b, None, made), x, w)
            assert all(torch.isfinite(t).all() for t in got), (k, n, tokens)


@one_arch
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_every_grouped_shape_the_router_accepts_runs(recipe):
    backend, device = tp.registry.get_backend("primus_turbo"), tp.device_profile(ARCH)
    made = backend.recipe_for(recipe, device)
    accepted = [(k, n) for k in DIMS for n in DIMS if backend.supports("grouped_mm", recipe, device, k=k, n=n)]
    assert accepted
    offs = torch.tensor([1, 1, 18], dtype=torch.int32)  # one token, an empty expert, 3 trailing rows
    for k, n in accepted:
        A, W = torch.randn(21, k, dtype=torch.bfloat16), torch.randn(3, n, k, dtype=torch.bfloat16)
        got = grads(lambda a, w: backend.grouped_mm(a, w.transpose(-2, -1), offs, made), A, W)
        assert all(torch.isfinite(t).all() for t in got), (k, n)


def test_parity_command_checks_primus_turbo_against_the_emulation(tmp_path, monkeypatch):
    """The parity machinery with Primus-Turbo as a third backend, on cases of the dims its Triton
    kernels take (the --quick set's are smaller)."""
    import json

    from titan_primus.cli import main
    from titan_primus.diagnostics import parity
    from titan_primus.diagnostics.parity import GroupedCase, LinearCase

    monkeypatch.setattr(
        parity,
        "QUICK_CASES",
        (
            LinearCase(name="m255", m=255, k=256, n=256, why="M not a multiple of 16"),
            GroupedCase(
                name="empty_groups_trailing_rows",
                counts=(9, 0, 21, 6),
                trailing=5,
                k=256,
                n=256,
                why="an empty group and rows past offs[-1]",
            ),
        ),
    )
    path = tmp_path / "parity.json"
    assert main(["parity", "--quick", "--device", ARCH, "--require", "primus_turbo", "--json", str(path)]) == 0
    rows = [r for r in json.loads(path.read_text())["results"] if r["backend"] == "primus_turbo"]
    ran = [r for r in rows if r["status"] == "pass"]
    assert {r["recipe"] for r in ran} >= {"tensorwise", "rowwise"}
    for row in ran:
        same = [c for c in row["checks"] if c["against"] == "emulated"]
        assert row["definition"] == "primus_turbo" and same and all(c["passed"] for c in same)
