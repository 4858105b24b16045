"""Memory parity: no backend keeps a copy of a weight from forward to backward (under FSDP2 every
layer's copy would stay resident at once: what FSDP exists to avoid), and activations are kept
in one precision, FP8 where the backend's backward multiplies FP8 copies of them.

Single ops here (titan_primus.diagnostics.memory.saved.audit_layer: every backend, recipe, op, eager and compiled,
with the weight as FSDP2 hands it over, bf16 or all-gathered in FP8); converted debug models under
2-rank FSDP2 in test_memory_fsdp below; the cases: tests/support/memory_audit.py. Primus-Turbo's own
code: tests/real_turbo/test_checkpointing_and_memory_audit.py."""

import pytest
from support.memory_audit import NOT_RUN, audit_case, case_id, cases, fp8_gathered, kept_per_rank
from support.ranks import torchrun_script


def test_every_case_not_listed_runs():
    ran = [c for c in cases() if (c[0], c[2], c[3]) not in NOT_RUN and (not c[5] or fp8_gathered(*c[:4]))]
    assert len(ran) == 62, len(ran)  # of 96: 36 eager, 26 compiled; TorchAO grouped: eager and compiled


@pytest.mark.parametrize("case", list(cases()), ids=case_id)
def test_no_weight_copy_outlives_the_forward(case, monkeypatch):
    audit_case(case, monkeypatch)


FSDP_CASES = [
    ("llama3", "tensorwise", "cpu", "emulated", ()),
    ("llama3", "tensorwise", "cpu", "emulated", ("fp8_all_gather",)),
    ("deepseek_v3", "rowwise", "gfx942", "emulated", ("fp8_all_gather",)),
    ("llama3", "tensorwise", "cpu", "torchao", ("fp8_all_gather",)),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("model, recipe, device, backend, options", FSDP_CASES)
def test_memory_fsdp(model, recipe, device, backend, options):
    """A converted debug model under 2-rank FSDP2 (gloo; bf16 params, every block resharded
    after its forward): once the forward is over, no storage autograd keeps for backward holds
    a tensor shaped like an FP8 layer's weight, except the parameters FSDP2 manages (freed
    after each block's forward, or the root's, kept unsharded). Measured (2026-12-01, rank 0):
    see the script's output in docs/measurements.md."""
    out = torchrun_script("memory_fsdp.py", model, recipe, device, backend, *options)
    for copies, fp8, _, _, resharded in kept_per_rank(out).values():
        assert resharded and copies == 0, out
        if backend == "primus_turbo":
            assert fp8 > 0, out  # its backward multiplies FP8 activations, kept as FP8
