"""Selective activation checkpointing keeps Primus-Turbo's FP8 GEMMs (TorchTitan 0.3's
``Fp8SelectiveAC``), and the product's memory audit (``titan_primus.diagnostics.memory.saved``, ``bench
--memory``) finds no weight copy on Primus-Turbo's own code: the main suite's tests
(tests/integrations/torchtitan/v0_3/test_activation_checkpointing.py, tests/unit/test_memory.py) with Primus-Turbo."""

import contextlib
import sys

import pytest
from support.memory_audit import audit_case, case_id, cases, kept_per_rank
from support.titan_helpers import gemms_per_step, model_config

import titan_primus as tp
from real_turbo.conftest import ARCH, BUILD, NOT_RUN_HERE, one_arch
from real_turbo.calls import DISPATCHERS
from titan_primus.diagnostics.memory.saved import AUDIT_SHAPES, audit_layer
from titan_primus.torchtitan import Float8Converter, Fp8SelectiveAC


@contextlib.contextmanager
def _counted_dispatch():
    """Calls into Primus-Turbo's GEMM kernel dispatchers (one per GEMM that runs), eager or
    compiled: with activation checkpointing an op served from its cache never gets there."""
    calls, patched = [0], []
    for module, classes in DISPATCHERS.items():
        for name in classes:
            dispatcher = getattr(sys.modules[module], name)
            own = dispatcher.__dict__.get("dispatch")  # else inherited from AutoKernelDispatcher

            def counted(cls, *args, _real=dispatcher.dispatch.__func__, **kwargs):
                calls[0] += 1
                return _real(cls, *args, **kwargs)

            dispatcher.dispatch = classmethod(counted)
            patched.append((dispatcher, own))
    try:
        yield calls
    finally:
        for dispatcher, own in patched:
            if own is None:
                del dispatcher.dispatch
            else:
                dispatcher.dispatch = own


def _count(fn, ops, compiled):
    with _counted_dispatch() as calls:
        result = fn()
    return result, calls[0]


# A model's steps counted three times: about 60 s a model under the interpreter (2026-12-04), so
# each model at one of the two builds AMD's images carry.
SELECTIVE_AC_BUILDS = {"llama3": "v0.3.2.dev48", "deepseek_v3": "v0.4.1.dev26"}


@one_arch
@pytest.mark.parametrize(
    "model, compiled", [("llama3", True), ("deepseek_v3", False)], ids=["llama3-compiled", "deepseek_v3-eager"]
)
def test_selective_ac_runs_three_fp8_gemms_per_op(model, compiled):
    """Without activation checkpointing and with Fp8SelectiveAC saving every FP8 GEMM: 3 FP8 GEMMs
    per op per step."""
    if BUILD != SELECTIVE_AC_BUILDS[model]:
        pytest.skip(f"costly: {model} runs at {SELECTIVE_AC_BUILDS[model]}")
    ops = tp.registry.get_backend("primus_turbo").fp8_gemm_ops()
    assert ops
    converter = Float8Converter.Config(device=ARCH, backend="primus_turbo", recipe="rowwise").build()
    config = converter.convert(model_config(model))
    forward, plain = gemms_per_step(config, None, compiled, ops, count=_count)
    _, fp8 = gemms_per_step(config, Fp8SelectiveAC.Config(fp8_gemms="save"), compiled, ops, count=_count)
    assert forward > 0 and plain == 3 * forward and fp8 == plain, (forward, plain, fp8)


@pytest.mark.parametrize("case", list(cases(backends=(("primus_turbo", ARCH, ARCH),))), ids=case_id)
def test_no_weight_copy_outlives_the_forward(case, monkeypatch):
    recipe = case[3]
    if recipe in NOT_RUN_HERE:
        pytest.skip(NOT_RUN_HERE[recipe])
    audit_case(case, monkeypatch)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_primus_turbo_keeps_its_activations_in_fp8(recipe):
    backend = tp.registry.get_backend("primus_turbo")
    made = backend.recipe_for(recipe, tp.device_profile(ARCH))
    for op, shape in AUDIT_SHAPES.items():
        kept = audit_layer(backend, made, shape, False, False)["kept"]
        assert kept["weight_copy"] == 0 and kept["activation_hp"] == 0, kept
        assert kept["activation_fp8"] == shape.rows * shape.k, kept


@pytest.mark.multiprocess
@pytest.mark.skipif(
    (BUILD, ARCH) != ("v0.4.0", "gfx942"),
    reason="one build and arch only (minutes under the interpreter); the one-process audit above runs everywhere",
)
def test_memory_under_fsdp2():
    from support.ranks import torchrun_script

    # 320 tokens: fewer would be zero-padded to 256 rows for the dense wgrad, an activation shaped
    # like the debug model's [256, K] weights.
    out = torchrun_script("memory_fsdp.py", "deepseek_v3", "rowwise", ARCH, "primus_turbo", "seq=160")
    for copies, fp8, _, _, resharded in kept_per_rank(out).values():
        assert resharded and copies == 0 and fp8 > 0, out
