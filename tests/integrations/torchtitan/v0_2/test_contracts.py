"""What TorchTitan 0.2.2 sees of a converted model: its dtypes under the autocast its trainer
enables, unaligned expert dims, and what 0.2.2 asks about quantization (nothing the 0.3
has_quantization covers)."""

import inspect
from importlib.metadata import version

import torch
from torch import nn
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.models.moe.moe import GroupedExperts
from tt02_helpers import convert, materialize, meta_model, tokens

from titan_primus.torchtitan02 import Fp8GroupedExperts


def linear_output_dtypes(model: nn.Module) -> tuple[torch.dtype, dict]:
    dtypes = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda m, i, o, name=name: dtypes.__setitem__(name, o.dtype))
    # What TorchTitan 0.2.2's maybe_enable_amp enables on a single device (mixed_precision_param bf16).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens(seq=16))
    return logits.dtype, dtypes


def test_converted_model_keeps_stock_dtypes_under_autocast():
    stock = linear_output_dtypes(materialize(meta_model("llama3")))
    model = meta_model("llama3")
    convert(model)
    converted = linear_output_dtypes(materialize(model))
    assert stock[0] == converted[0] == torch.bfloat16
    assert stock[1] == converted[1] and set(converted[1].values()) == {torch.bfloat16}


def test_expert_block_with_unaligned_dims_trains():
    """Experts whose dims torch._grouped_mm cannot take unpadded (not multiples of 8)."""
    with torch.device("meta"):
        model = nn.ModuleDict({"experts": GroupedExperts(dim=20, hidden_dim=12, num_experts=4, use_grouped_mm=True)})
    report = convert(model).report
    assert [r.backend for r in report.layers] == ["emulated"]
    experts = model["experts"]
    assert isinstance(experts, Fp8GroupedExperts)
    experts.to_empty(device="cpu")
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    x = torch.randn(30, 20, requires_grad=True)
    out = experts(x, torch.tensor([7, 0, 13, 10]))
    out.backward(torch.randn_like(out))
    assert out.shape == (30, 20) and torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in experts.parameters())


def test_torchtitan_0_2_has_no_quantization_flag_to_set():
    """0.2.2 logs MFU for every run, its own float8 runs included: its metrics take no
    has_quantization (0.3 added it), so there is nothing to tell it (test_trainer.py checks the
    FP8 run logs MFU like the stock one). Its other "is this float8?" question,
    `"float8" in job_config.model.converters`, picks TorchAO's Float8 tensor-parallel plans and
    rightly stays False for titan_primus.float8 (its modules are not TorchAO's)."""
    assert "has_quantization" not in inspect.signature(MetricsProcessor.__init__).parameters


def test_every_seam_of_the_0_2_line_finds_its_target():
    """Issue 41: each patch of TorchTitan 0.2.x's internals is declared in v0_2/seams.py, and each
    target is in TorchTitan 0.2.2 (``titan-primus doctor`` lists them); ../test_seams.py checks
    every line's seams the same way, the CPU launcher's skipped wait among them."""
    from titan_primus.integrations.torchtitan import line_seams

    version, seams = line_seams()
    assert version.startswith("0.2") and {s.row()["missing"] for s in seams} == {None}
    assert {s.name for s in seams} >= {"sentinel_train_step", "cpu_device", "fp8_expert_parallel"}


def test_every_torchtitan_import_of_the_0_2_line_is_there():
    """docs/upgrades.md's TorchTitan 0.2.2 rows: each name the 0.2 line imports resolves here."""
    from titan_primus.diagnostics.contracts import resolve, torchtitan_imports

    imports = torchtitan_imports("v0_2")
    assert "torchtitan.models.moe.moe.GroupedExperts" in imports
    for name, (_, optional) in imports.items():
        if not optional:
            resolve(name)


def test_doctor_finds_every_contract_of_the_0_2_line_here():
    """``titan-primus doctor``'s contract rows on TorchTitan 0.2.2: the 0.2 line's imports and
    patches are there, the 0.3 line's are another line's; nothing else differs but, on the oldest
    stack (TorchAO 0.15), TorchAO's FP8 grouped GEMM, which arrived in 0.17 (doctor names it)."""
    from titan_primus.diagnostics.contracts import contract_states

    states = contract_states()
    assert {s["state"] for s in states if s["line"] == "v0_2"} <= {"ok", "absent (optional)"}
    assert {s["state"] for s in states if s["line"] == "v0_3"} == {"other line"}
    differs = [s["symbol"] for s in states if s["state"] == "differs"]
    grouped = [s["symbol"] for s in states if "_to_fp8_rowwise_then_scaled_grouped_mm" in s["symbol"]]
    torchao_grouped_mm = tuple(int(part) for part in version("torchao").split(".")[:2]) >= (0, 17)
    assert differs == ([] if torchao_grouped_mm else grouped), differs
