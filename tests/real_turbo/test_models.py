"""TorchTitan 0.3's MoE debug model converted for an MI300-class profile trains a step on
Primus-Turbo's own code, and agrees with the same model converted to the emulation of
Primus-Turbo's definition as closely as the emulation agrees with itself after a last-bit change."""

import torch
from support.titan_helpers import build, model_config

import titan_primus as tp
from real_turbo.conftest import ARCH, one_arch
from titan_primus.torchtitan import Float8Converter

# The emulation against itself with the embeddings changed in their last bits: how far FP8
# rounding carries a last-bit difference through the model. Primus-Turbo's kernels and the
# emulation differ by that much (accumulation order, single elements one bf16 ulp apart); a
# real defect (a wrong scale, layout or operand) costs far more than MARGIN_DB.
PERTURBATION = 1e-6
MARGIN_DB = 6.0


def _step(model, tokens):
    out = model(tokens)
    out.float().pow(2).mean().backward()
    return out.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _agreement(a, b) -> tuple[float, float]:
    """(SQNR of the logits, worst SQNR over the parameter gradients) of ``b`` against ``a``."""
    return tp.sqnr(a[0], b[0]), min(tp.sqnr(a[1][name], b[1][name]) for name in a[1])


@one_arch
def test_converted_moe_model_trains_a_step_like_the_emulation():
    converter = Float8Converter.Config(device=ARCH, recipe="rowwise").build()
    config = converter.convert(model_config("deepseek_v3"))
    assert {d.backend_name for d in converter.report.decisions.values()} == {"primus_turbo"}, converter.report.summary()
    emulated = (
        Float8Converter.Config(device=ARCH, recipe="rowwise", backend="emulated")
        .build()
        .convert(model_config("deepseek_v3"))
    )
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))

    turbo = _step(build(config, seed=0), tokens)
    assert torch.isfinite(turbo[0]).all() and all(torch.isfinite(g).all() for g in turbo[1].values())
    reference = _step(build(emulated, seed=0), tokens)
    perturbed_model = build(emulated, seed=0)
    with torch.no_grad():
        embeddings = perturbed_model.tok_embeddings.weight
        embeddings.mul_(1 + PERTURBATION * torch.randn(embeddings.shape, generator=torch.Generator().manual_seed(1)))
    perturbed = _step(perturbed_model, tokens)

    baseline = _agreement(reference, perturbed)
    measured = _agreement(reference, turbo)
    assert turbo[1].keys() == reference[1].keys()
    assert measured[0] >= baseline[0] - MARGIN_DB, (measured, baseline)
    assert measured[1] >= baseline[1] - MARGIN_DB, (measured, baseline)
