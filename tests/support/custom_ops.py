"""Checking titan-primus's custom ops: every name its sources register, what ``torch.library.opcheck``
can check on a CPU, and output aliasing (tests/unit/test_custom_ops.py, tests/real_turbo)."""

import re

import torch

from support.repo_root import ROOT

__all__ = ["WITHOUT_FP8_ARITHMETIC", "defined_ops", "no_output_aliases_an_input"]

# On a CPU, opcheck's schema and AOT-dispatch checks sum or multiply every output, which torch
# cannot do for FP8 there (torch 2.14: "sum_cpu" / "mul_cpu_reduced_float" not implemented for
# 'Float8_e4m3fn'); an op with FP8 outputs gets the other two, and its aliasing is checked here.
WITHOUT_FP8_ARITHMETIC = ("test_autograd_registration", "test_faketensor")


def defined_ops() -> set[str]:
    """Every op name the package's sources register (imported or not)."""
    sources = (path.read_text() for path in (ROOT / "titan_primus").rglob("*.py"))
    return {name for text in sources for name in re.findall(r'custom_op\(\s*"(titan_primus::\w+)"', text)}


def no_output_aliases_an_input(op, args):
    """``op(*args)`` returns no tensor sharing storage with an input tensor."""
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    outputs = op(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert not inputs & {o.untyped_storage().data_ptr() for o in outputs}
