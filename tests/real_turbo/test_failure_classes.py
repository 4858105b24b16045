"""The field failure classes (tests/integrations/torchtitan/v0_3/test_failure_classes.py: gradient accumulation over
microbatches, stale rows, determinism) and the numerics sentinel's check (tests/unit/test_sentinel.py)
on Primus-Turbo's own code."""

import pytest
import torch

from support.failure_classes import FAILURE_CLASSES
from support.sentinel_calls import checked_call, sentinel_inputs
import titan_primus as tp
from real_turbo.conftest import ARCH, BUILD
from titan_primus import sentinel
from titan_primus.sentinel import SentinelOptions, WatchedBackend

RECIPES = ["tensorwise", "rowwise"]
CASE = ("primus_turbo", ARCH)


@pytest.mark.parametrize("failure_class", FAILURE_CLASSES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("recipe", RECIPES)
def test_failure_class(failure_class, recipe):
    failure_class(*CASE, recipe)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_sentinel_passes_primus_turbo(recipe):
    """The sentinel recomputes a checked layer with the exact emulation of the same definition:
    Primus-Turbo's own code reaches the same-definition floor (no false alarm)."""
    impl = tp.registry.get_backend("primus_turbo")
    made = impl.recipe_for(recipe, tp.device_profile(ARCH))
    active = sentinel.sentinel_for(SentinelOptions(1))
    generator = torch.Generator().manual_seed(1)
    for op in ("linear", "grouped_mm"):
        layer = active.register(f"layer.{op}", impl)
        active.begin_step(layer.index + 1)
        inputs = list(sentinel_inputs(op, generator))
        if op == "linear":  # N >= 256: Primus-Turbo's Triton kernels
            inputs[1] = (torch.randn(256, 256, generator=generator) * 0.05).bfloat16()
            inputs[2] = torch.randn(256, generator=generator).bfloat16()
            inputs[3] = torch.randn(64, 256, generator=generator).bfloat16()
        report = checked_call(WatchedBackend(active, layer), op, made, inputs)
        assert report.checked_layer == layer.name and len(report.checks) == 1
        assert report.checks[0].passed, report.checks[0].problems


@pytest.mark.multiprocess
@pytest.mark.skipif(
    (BUILD, ARCH) != ("v0.3.2.dev48", "gfx950"),
    reason="one build and arch only (minutes under the interpreter); the one-process tests above run everywhere",
)
def test_fsdp2_gradient_accumulation_with_fp8_all_gather_on_and_off():
    from support.ranks import every_rank, torchrun_script

    for r in every_rank(torchrun_script("grad_accumulation.py")):
        b = r["primus_turbo"]
        assert b["on_equals_off_bitwise"], r
        baseline = b["big_batch_vs_bf16_db"]
        assert b["vs_big_batch_db"] >= baseline - 6 and b["dropped_microbatch_db"] < baseline - 10, r
