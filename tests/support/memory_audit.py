"""The memory audit's cases (titan_primus.diagnostics.memory.saved.audit_layer: every backend, recipe,
op, eager and compiled, the weight bf16 or all-gathered in FP8), what each must find, and the
2-rank FSDP2 script's report (memory_fsdp.py): shared by tests/unit/test_memory.py and the
Primus-Turbo tier."""

import re

import pytest

import titan_primus as tp
from support.doubles import torchao_grouped_kernels
from titan_primus.diagnostics.memory.saved import AUDIT_SHAPES, audit_layer
from titan_primus.fsdp_fp8 import fp8_all_gather_plan
from titan_primus.recipes import RECIPE_NAMES

COMPILED_RECIPES = ("tensorwise", "rowwise", "blockwise")  # compile time: the other recipes' paths are alike
# TorchAO's grouped GEMM runs on a CPU as its own Python on CPU stand-ins for its Triton kernels
# and torch._scaled_grouped_mm (tests/support/doubles/torchao_grouped_kernels.py), routed as on SM90.
BACKENDS = (("emulated", "cpu", "cpu"), ("emulated", "gfx942", "gfx942"), ("torchao", "cpu", "sm90"))
# What does not run, written here (not asked of the code under test): every other case runs.
NOT_RUN = {
    ("torchao", "linear", "blockwise"): "runs on NVIDIA SM90 only",  # F.scaled_mm blockwise: CUDA
    ("torchao", "grouped_mm", "tensorwise"): "only the rowwise recipe",
    ("torchao", "grouped_mm", "rowwise_with_gw_hp"): "only the rowwise recipe",
    ("torchao", "grouped_mm", "mxfp8"): "need NVIDIA SM100",
    ("torchao", "grouped_mm", "blockwise"): "DeepGEMM",
    ("primus_turbo", "linear", "rowwise_with_gw_hp"): "no 'rowwise_with_gw_hp' recipe",
    ("primus_turbo", "grouped_mm", "rowwise_with_gw_hp"): "no 'rowwise_with_gw_hp' recipe",
}


def fp8_gathered(backend: str, device: str, op: str, recipe: str) -> bool:
    """Where FSDP2 all-gathers the weight in FP8 (elsewhere in bf16): tensorwise, rowwise as
    Primus-Turbo defines it (on MI300-class devices; exact: its backward re-quantizes the weight
    from its forward FP8 copy), and blockwise (square weight blocks serve both GEMMs) where the
    backend takes FP8 blocks (not TorchAO's); never into TorchAO's grouped GEMM, which quantizes
    B_t itself."""
    if backend == "torchao" and (op == "grouped_mm" or recipe == "blockwise"):
        return False
    return recipe in ("tensorwise", "blockwise") or (device.startswith("gfx") and recipe == "rowwise")


def cases(backends=BACKENDS):
    for backend, linear_device, grouped_device in backends:
        for op in ("linear", "grouped_mm"):
            for recipe in RECIPE_NAMES:
                for compiled in (False, True):
                    if compiled and recipe not in COMPILED_RECIPES:
                        continue
                    for all_gather in (False, True):
                        device = linear_device if op == "linear" else grouped_device
                        yield backend, device, op, recipe, compiled, all_gather


def case_id(case):
    backend, device, op, recipe, compiled, all_gather = case
    return f"{backend}-{device}-{op}-{recipe}-{'compiled' if compiled else 'eager'}{'-fp8_all_gather' if all_gather else ''}"


def audit_case(case, monkeypatch):
    """One audit case: tests/unit/test_memory.py's, and on Primus-Turbo's own code tests/real_turbo's."""
    backend_name, device, op, recipe_name, compiled, all_gather = case
    backend = tp.registry.get_backend(backend_name)
    profile = tp.device_profile(device)
    shape = AUDIT_SHAPES[op]
    verdict = backend.availability(profile)
    verdict = verdict and backend.supports(op, recipe_name, profile, k=shape.k, n=shape.n)
    not_run = NOT_RUN.get((backend_name, op, recipe_name))
    if not_run:
        assert not verdict and not_run in verdict.reason, verdict
        pytest.skip(verdict.reason)
    assert verdict, verdict.reason
    recipe = backend.recipe_for(recipe_name, profile)
    plan, why = fp8_all_gather_plan(backend, recipe, op)
    assert (plan is not None) == fp8_gathered(backend_name, device, op, recipe_name), why
    if all_gather and plan is None:
        pytest.skip(f"gathered in bf16: {why.reason}")
    torchao_grouped = backend_name == "torchao" and op == "grouped_mm"
    if torchao_grouped:
        torchao_grouped_kernels.install(monkeypatch)
    result = audit_layer(backend, recipe, shape, compiled, all_gather)
    kept = result["kept"]
    assert kept["weight_copy"] == 0, kept
    # The parameter (FSDP-managed storage) may be kept, and nothing else of weight size.
    assert kept["activation_fp8"] == 0 or kept["activation_hp"] == 0, kept  # one precision
    if torchao_grouped:
        # TorchAO keeps the routed tokens it is handed: the caller's, not a masked copy (w1 and
        # w3 of a MoE block then share one), as in stock TorchTitan.
        assert result["input_by_reference"] and kept["activation_hp"] == shape.rows * shape.k * 2, result
    if backend_name == "primus_turbo" and recipe_name in ("tensorwise", "rowwise"):
        # Its backward multiplies FP8 copies of the activations: those are what it keeps.
        assert kept["activation_hp"] == 0 and kept["activation_fp8"] == shape.rows * shape.k, kept


KEPT = re.compile(
    r"rank (\d+) kept after the forward, per rank: weight copies (\d+) B, FP8 activations (\d+) B, "
    r"other activations (\d+) B, parameters and buffers (\d+) B; weights resharded: (True|False)"
)


def kept_per_rank(out: str) -> dict[int, tuple[int, int, int, int, bool]]:
    """memory_fsdp.py's line of each rank: weight copies, FP8 activations, other activations,
    parameters and buffers (bytes), and whether the blocks' weights are resharded; both ranks
    must have reported."""
    kept = {int(rank): (*map(int, sizes), resharded == "True") for rank, *sizes, resharded in KEPT.findall(out)}
    assert sorted(kept) == [0, 1], out
    return kept
