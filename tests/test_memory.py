"""Memory parity: no backend keeps a copy of a weight from forward to backward (under FSDP2 every
layer's copy would stay resident at once: what FSDP exists to avoid), and activations are kept
in one precision, FP8 where the backend's backward multiplies FP8 copies of them.

Single ops here (titan_primus.memory.audit_layer: every backend, recipe, op, eager and compiled,
with the weight as FSDP2 hands it over, bf16 or all-gathered in FP8); converted debug models under
2-rank FSDP2 in test_memory_fsdp below. Primus-Turbo's own code: tests/real_turbo/test_memory.py."""

import re

import pytest
from test_distributed import torchrun_script

import titan_primus as tp
from titan_primus.fsdp_fp8 import fp8_all_gather_plan
from titan_primus.memory import AUDIT_SHAPES, audit_layer
from titan_primus.recipes import RECIPE_NAMES

COMPILED_RECIPES = ("tensorwise", "rowwise", "blockwise")  # compile time: the other recipes' paths are alike


def cases(backends=(("emulated", "cpu"), ("emulated", "gfx942"), ("torchao", "cpu"))):
    for backend, device in backends:
        for op in ("linear", "grouped_mm"):
            for recipe in RECIPE_NAMES:
                for compiled in (False, True):
                    if compiled and recipe not in COMPILED_RECIPES:
                        continue
                    for all_gather in (False, True):
                        yield backend, device, op, recipe, compiled, all_gather


def _case_id(case):
    backend, device, op, recipe, compiled, all_gather = case
    return f"{backend}-{device}-{op}-{recipe}-{'compiled' if compiled else 'eager'}{'-fp8_all_gather' if all_gather else ''}"


@pytest.mark.parametrize("case", list(cases()), ids=_case_id)
def test_no_weight_copy_outlives_the_forward(case):
    backend_name, device, op, recipe_name, compiled, all_gather = case
    backend = tp.registry.get_backend(backend_name)
    profile = tp.device_profile(device)
    shape = AUDIT_SHAPES[op]
    available = backend.availability(profile)
    supported = backend.supports(op, recipe_name, profile, k=shape.k, n=shape.n)
    if not (available and supported):
        pytest.skip((available if not available else supported).reason)
    recipe = backend.recipe_for(recipe_name, profile)
    if all_gather and fp8_all_gather_plan(backend, recipe, op)[0] is None:
        pytest.skip(fp8_all_gather_plan(backend, recipe, op)[1].reason)
    result = audit_layer(backend, recipe, shape, compiled, all_gather)
    kept = result["kept"]
    assert kept["weight_copy"] == 0, kept
    # The parameter (FSDP-managed storage) may be kept, and nothing else of weight size.
    assert kept["activation_fp8"] == 0 or kept["activation_hp"] == 0, kept  # one precision
    if backend_name == "primus_turbo" and recipe_name in ("tensorwise", "rowwise"):
        # Its backward multiplies FP8 copies of the activations: those are what it keeps.
        assert kept["activation_hp"] == 0 and kept["activation_fp8"] == shape.rows * shape.k, kept


FSDP_CASES = [
    ("llama3", "tensorwise", "cpu", "emulated", ()),
    ("llama3", "tensorwise", "cpu", "emulated", ("fp8_all_gather",)),
    ("deepseek_v3", "rowwise", "gfx942", "emulated", ("fp8_all_gather",)),
    ("llama3", "tensorwise", "cpu", "torchao", ("fp8_all_gather",)),
]
KEPT = re.compile(
    r"kept after the forward, per rank: weight copies (\d+) B, FP8 activations (\d+) B, "
    r"other activations (\d+) B, parameters and buffers (\d+) B; weights resharded: (True|False)"
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("model, recipe, device, backend, options", FSDP_CASES)
def test_memory_fsdp(model, recipe, device, backend, options):
    """A converted debug model under 2-rank FSDP2 (gloo; bf16 params, every block resharded
    after its forward): once the forward is over, no storage autograd keeps for backward holds
    a tensor shaped like an FP8 layer's weight, except the parameters FSDP2 manages (freed
    after each block's forward, or the root's, kept unsharded). Measured (2026-12-01, rank 0):
    see the script's output in docs/measurements.md."""
    out = torchrun_script("memory_fsdp.py", model, recipe, device, backend, *options)
    copies, fp8, hp, params, resharded = KEPT.search(out).groups()
    assert resharded == "True", out
    assert int(copies) == 0, out
    if backend == "primus_turbo":
        assert int(fp8) > 0, out  # its backward multiplies FP8 activations, kept as FP8
